"""``ds-ulysses`` command line: exit codes, the one-line summary, errors on stderr."""

import json
import os
import subprocess
import sys

import pytest

from ds_ulysses import cli
from tests.support import REPO


def write(tmp_path, payload, name="ds.json") -> str:
    path = tmp_path / name
    path.write_text(payload if isinstance(payload, str) else json.dumps(payload))
    return str(path)


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("section,summary", [
    ({"sequence_parallel_size": 4},
     "ok: mesh dp=auto sp=4 | attention sdpa | tiled_mlp off, tiled_loss auto, ckpt_offload off"),
    ({"mesh_param": [2, 4], "attn_implementation": "flex_attention",
      "tiled_mlp": {"enabled": True, "shards": 8}, "tiled_loss": {"enabled": False},
      "activation_checkpoint_offload": {"enabled": True}},
     "ok: mesh dp=2 sp=4 | attention flex_attention | tiled_mlp 8, tiled_loss off, "
     "ckpt_offload on"),
])
def test_validate_valid_file_prints_one_line_summary(tmp_path, capsys, section, summary):
    code, out, err = run(capsys, "validate", write(tmp_path, {"ulysses": section}))
    assert (code, out, err) == (0, summary + "\n", "")


def test_validate_world_size_resolves_dp(tmp_path, capsys):
    path = write(tmp_path, {"ulysses": {"sequence_parallel_size": 2}})
    code, out, _ = run(capsys, "validate", path, "--world-size", "8")
    assert code == 0 and out.startswith("ok: mesh dp=4 sp=2 |")
    code, out, err = run(capsys, "validate", path, "--world-size", "7")
    assert (code, out) == (2, "")
    assert err.startswith(f"{path}: sequence_parallel_size: expected sp to divide "
                          "world_size, got sp=2 and world_size=7")


def test_validate_without_section_is_ok(tmp_path, capsys):
    code, out, _ = run(capsys, "validate", write(tmp_path, {"train_batch_size": 4}))
    assert code == 0 and 'no "ulysses" section' in out


def test_validate_invalid_file_lists_every_error_on_stderr(tmp_path, capsys):
    path = write(tmp_path, {"ulysses": {"sequence_paralel_size": 2, "attn_implementation": "eager",
                                        "tiled_mlp": {"shards": "many"}}})
    code, out, err = run(capsys, "validate", path)
    assert (code, out) == (2, "")
    lines = err.splitlines()
    assert len(lines) == 3 and all(line.startswith(f"{path}: ulysses.") for line in lines)
    assert "ulysses.attn_implementation:" in lines[0] and "eager needs a full S x S" in lines[0]
    assert "did you mean 'sequence_parallel_size'?" in lines[1]
    assert 'ulysses.tiled_mlp.shards: expected "auto" or an integer >= 1, got "many"' in lines[2]


@pytest.mark.parametrize("payload,phrase", [
    ('{"ulysses": {"sequence_parallel_size": 2,}}', "expected a DeepSpeed config in JSON"),
    ("not json at all", "expected a DeepSpeed config in JSON"),
    ('"a string"', "config: expected a JSON object"),
])
def test_validate_non_json_file_exits_2(tmp_path, capsys, payload, phrase):
    path = write(tmp_path, payload)
    code, out, err = run(capsys, "validate", path)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith(path) and phrase in err


def test_validate_unreadable_file_exits_2(tmp_path, capsys):
    missing = str(tmp_path / "nope.json")
    code, _, err = run(capsys, "validate", missing)
    assert code == 2 and err.startswith(f"{missing}: expected a readable") and "No such" in err
    code, _, err = run(capsys, "validate", str(tmp_path))  # a directory is not a file
    assert code == 2 and "expected a readable" in err


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        cli.main(["validate"])
    assert info.value.code == 2
    assert "CONFIG.json" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["ds_config_cpu.json", "ds_config.json"])
def test_examples_validate(capsys, name):
    code, out, _ = run(capsys, "validate", str(REPO / "examples" / name))
    assert code == 0 and out.startswith("ok: mesh dp=auto")


def test_subcommands_are_one_table_entry_each(monkeypatch, capsys):
    def add(parser):
        parser.add_argument("--n", type=int, default=1)

    def go(args):
        print(f"n={args.n}")
        return 0

    monkeypatch.setitem(cli.SUBCOMMANDS, "echo", cli.Subcommand("test only", add, go))
    assert run(capsys, "echo", "--n", "3")[:2] == (0, "n=3\n")
    assert "validate" in cli.build_parser().format_help()


def test_module_entry_point_in_a_subprocess(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    ok = subprocess.run([sys.executable, "-m", "ds_ulysses.cli", "validate",
                         str(REPO / "examples" / "ds_config_cpu.json")],
                        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip().splitlines()[-1] == (
        "ok: mesh dp=auto sp=2 | attention sdpa | tiled_mlp off, tiled_loss auto, "
        "ckpt_offload off")
    bad = subprocess.run([sys.executable, "-m", "ds_ulysses.cli", "validate",
                          write(tmp_path, {"ulysses": {"sequence_parallel_size": 0}})],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert bad.returncode == 2 and "ulysses.sequence_parallel_size: expected an integer >= 1, " \
                                   "got 0" in bad.stderr
