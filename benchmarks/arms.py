"""What the harness compares: the arms, the loops they run in and the model they train.

One home for the names every layer shares (the command line offers them, the suites launch them, a rank runs
them, the report pairs them), so that none of those imports another for a constant. It imports nothing, not even
torch: a launched rank imports it without loading ds_ulysses, so DeepSpeed's arm measures without our package
in the process.
"""

from __future__ import annotations

__all__ = ["IMPLEMENTATIONS", "LOOP_IMPLEMENTATIONS", "LOOPS", "NOISE_ARM", "TILED_OPS", "MODEL_DEFAULTS",
           "ALST_SECTION", "LLAMA8B_SHAPED", "BREAKDOWN_RECIPES", "impl_name", "arms"]

# the engine loop's arms (benchmarks.recipes builds each): DeepSpeed's tutorial recipe, our drop-in API under the
# same code, our initialize with the section's defaults, DeepSpeed with every ALST tool (ArcticTraining's setup)
IMPLEMENTATIONS = ("deepspeed", "ours-dropin", "ours", "deepspeed-alst")
# the arms a user of the Trainer, Accelerate's loop or TRL can switch on (benchmarks.framework_loop)
LOOP_IMPLEMENTATIONS = ("deepspeed", "ours-dropin", "ours")
LOOPS = {"engine": "step", "trainer": "trainer", "accelerate": "accelerate", "trl": "trl"}  # --loop -> records' kind
NOISE_ARM = "deepspeed[again]"
TILED_OPS = ("tiled_mlp", "stc_mlp", "stc_loss", "fused_loss")  # --tiled-iters' operations (benchmarks.tiled)
MODEL_DEFAULTS = {"vocab": 32000, "hidden": 256, "intermediate": 688, "layers": 4, "heads": 8, "kv_heads": 2}

# python -m benchmarks.breakdown: our section's ALST switches (the tiled loss is on by default) against DeepSpeed's
# ALST recipe, on Llama-3.1-8B's per-layer proportions (h : I : kv : V) scaled down to a CPU (issue 67's model)
ALST_SECTION = {"tiled_mlp": {"enabled": True}, "activation_checkpoint_offload": {"enabled": True}}
LLAMA8B_SHAPED = {"vocab": 32000, "hidden": 1024, "intermediate": 3584, "layers": 2, "heads": 8, "kv_heads": 2}
BREAKDOWN_RECIPES = ("ours", "deepspeed-alst")


def impl_name(impl: str, variant: str | None) -> str:
    return impl if not variant else f"{impl}[{variant}]"


def arms(impls, variants: dict | None = None, noise: bool = True) -> list[tuple[str, str, str | None, dict]]:
    """(name, impl, variant, section) per arm: the implementations, the noise arm after ``deepspeed``,
    then one ``ours[variant]`` per variant."""
    out = []
    for impl in impls:
        out.append((impl, impl, None, {}))
        if impl == "deepspeed" and noise:
            out.append((NOISE_ARM, "deepspeed", "again", {}))
    out += [(impl_name("ours", name), "ours", name, section) for name, section in (variants or {}).items()]
    return out
