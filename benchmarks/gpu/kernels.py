"""Which operators spend a training step's device time, phase by phase, for the GPU benchmark's arms.

A step time that differs between two arms by a few percent does not say where. With ``--profile``,
each trial of :mod:`benchmarks.gpu.longest` runs one more step after its timed ones (so the timed
figures carry no profiler overhead), each phase (forward, backward, optimizer) under its own
``torch.profiler``, and keeps, per phase, every operator's *self* device time summed over its calls: on
CUDA the kernels (and copies) the operator launched itself, not those of the operators it called, so
nothing is counted twice and ``aten::mm`` holds every matmul however it was reached; on the CPU the
operator's own CPU time. Two arms' tables side by side (:func:`differences`) name the operators where
one spends more than the other.

The first H200 run's profile (README, GPU section) was taken this way by a scratch driver; this makes
it one flag of the benchmark, so a GPU session's single call brings the tables back with the timings.
"""

from __future__ import annotations

__all__ = ["PHASES", "profiled_step", "operator_times", "differences"]

PHASES = ("forward", "backward", "optimizer")
TOP = 40  # operators kept per phase (by self device time): the rest of a step's operators are small


def profiled_step(engine, forward, sync, gpu: bool) -> dict:
    """One training step (``forward()``, ``engine.backward``, ``engine.step``), each phase profiled on its
    own: ``{phase: {"ms": all operators' self time, "operators": {operator: [ms, calls]}}}``
    (:func:`operator_times`)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if gpu else [ProfilerActivity.CPU]
    tables, loss = {}, None
    for phase in PHASES:
        sync()
        with profile(activities=activities) as prof:
            if phase == "forward":
                loss = forward()
            elif phase == "backward":
                engine.backward(loss)
            else:
                engine.step()
            sync()
        tables[phase] = operator_times(prof.key_averages(), gpu)
    return tables


def operator_times(averages, gpu: bool, top: int = TOP) -> dict:
    """``{"ms": total, "operators": {operator: [milliseconds, calls]}}``: the self time on the device (CUDA)
    or the CPU of every operator in ``key_averages()``, and of the `top` ones by name; kernels themselves
    are left out, their time being their operator's."""
    from torch.autograd import DeviceType

    rows = []
    for event in averages:
        if event.device_type != DeviceType.CPU:  # a kernel or copy: already in its launching operator's self time
            continue
        micros = _self_device_us(event) if gpu else event.self_cpu_time_total
        if micros > 0:
            rows.append((event.key, round(micros / 1000, 3), event.count))
    rows.sort(key=lambda row: -row[1])
    return {"ms": round(sum(ms for _, ms, _ in rows), 3),
            "operators": {name: [ms, calls] for name, ms, calls in rows[:top]}}


def _self_device_us(event) -> float:
    """Self device time in microseconds (``self_cuda_time_total`` before torch 2.4 named it so)."""
    value = getattr(event, "self_device_time_total", None)
    return value if value is not None else getattr(event, "self_cuda_time_total", 0.0)


def differences(ours: dict, theirs: dict, count: int = 8) -> dict:
    """Per phase of two :func:`profiled_step` results: (our total ms, their total ms, the `count` operators
    with the largest difference, each ``(operator, our ms, their ms)``). An operator missing from one arm's
    table counts 0 there (it is absent, or not among that arm's top :data:`TOP`)."""
    out = {}
    for phase in PHASES:
        a, b = ours.get(phase, {"ms": 0.0, "operators": {}}), theirs.get(phase, {"ms": 0.0, "operators": {}})
        ops_a, ops_b = a["operators"], b["operators"]
        rows = [(name, ops_a.get(name, [0.0])[0], ops_b.get(name, [0.0])[0]) for name in {*ops_a, *ops_b}]
        rows.sort(key=lambda row: (-abs(row[1] - row[2]), row[0]))
        out[phase] = (a["ms"], b["ms"], rows[:count])
    return out
