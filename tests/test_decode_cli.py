"""`python -m kimi_jax.decode`: the embedded default runs, and every bad input (damaged checkpoints included) is one
line on stderr + exit != 0; Ctrl-C is one line + exit 130, at once even mid-compile."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import FIXTURES, cpu_env, default_sigint

import kimi_jax
from kimi_jax.cli.decode import DEFAULT_PROMPT, _stats_line
from kimi_jax.cli.platform import accelerator_attached
from kimi_jax.cli.exits import run_command

ROOT = FIXTURES.parent.parent
TARGET, DRAFTER = ROOT / "checkpoints" / "target", ROOT / "checkpoints" / "drafter"
needs_default = pytest.mark.skipif(not (TARGET / "kimi_config.json").exists(), reason="embedded default not built")


@pytest.fixture
def decode(capfd):
    """`python -m kimi_jax.decode ARGS` in this process: main(argv), its status (argparse's exit included) and what
    it wrote to the process's stdout and stderr (file descriptors, so output from C++ counts too). The process
    itself is tested by test_cli_process_on_a_machine_without_gpu and the Ctrl-C tests."""
    from kimi_jax.cli.decode import main

    def run(*args):
        capfd.readouterr()
        try:
            status = main(list(args))
        except SystemExit as e:
            status = e.code
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(["kimi_jax.decode", *args], status, out, err)
    return run


def one_line_error(res, *words):
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    for w in words:
        assert w in lines[0], lines[0]


@needs_default
@pytest.mark.slow
def test_default_run_json(decode):
    res = decode("--max-new-tokens", "24", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["method"] == "ddtree" and 1 <= len(out["tokens"]) <= 24
    assert out["stats"]["dispatches"] == 1 and out["stats"]["mean_tau"] >= 1.0
    assert set(out["stats"]["width_per_round"]) <= {0, 4, 8, 16, 32}          # --budget auto is the default


@needs_default
@pytest.mark.slow
def test_json_schema_and_processors(decode, tmp_path):
    """--json-schema FILE: the printed reply validates against the schema (jsonschema); processors ride along."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "required": ["path", "size"], "additionalProperties": False,
              "properties": {"path": {"type": "string", "maxLength": 12}, "size": {"enum": ["small", "large"]}}}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    res = decode("--prompt", "entry = ", "--json-schema", str(tmp_path / "schema.json"), "--max-new-tokens", "64",
                 "--budget", "8", "--temperature", "1", "--top-p", "0.9", "--presence-penalty", "0.5", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    jsonschema.validate(json.loads(out["text"].replace("<|endoftext|>", "")), schema)


@needs_default
@pytest.mark.slow
def test_stream_prints_text_then_stats(decode):
    res = decode("--prompt", "import os\n", "--max-new-tokens", "16", "--stream", "--method", "dflash")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("import os\n") and len(res.stdout) > len("import os\n")
    assert "tok/s" in res.stderr and "dispatches" in res.stderr


def test_missing_checkpoint(decode):
    one_line_error(decode("--checkpoint", "/nonexistent/ck", "--method", "ar"), "does not exist")


def cli_process(*args, timeout=300):
    """`python -m kimi_jax.decode ARGS` as a user's shell runs it: no JAX_PLATFORMS, one CPU device."""
    env = cpu_env()
    del env["JAX_PLATFORMS"]
    return subprocess.run([sys.executable, "-m", "kimi_jax.decode", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


no_accelerator = pytest.mark.skipif(accelerator_attached(), reason="about machines without an accelerator")


@no_accelerator
def test_cli_process_without_an_accelerator_is_one_line():
    """The test extras install the CUDA plugin and libtpu; with JAX_PLATFORMS unset, neither may print before our
    one line (kimi_jax.cli.platform)."""
    res = cli_process("--checkpoint", "/nonexistent/ck")
    assert res.returncode == 1 and res.stdout == ""
    assert res.stderr == "kimi_jax.decode: error: checkpoint directory '/nonexistent/ck' does not exist\n", res.stderr


@no_accelerator
@needs_default
@pytest.mark.slow
def test_cli_process_decodes_the_embedded_default():
    """The smoke test of the real process: prompt + text on stdout, the stats line alone on stderr."""
    res = cli_process("--max-new-tokens", "8")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(DEFAULT_PROMPT) and len(res.stdout) > len(DEFAULT_PROMPT) + 1
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("[8 new tokens, ") and lines[0].endswith("]"), res.stderr


def test_choose_platforms(tmp_path):
    from kimi_jax.cli import platform
    (tmp_path / "nvidia0").touch()
    assert platform.accelerator_attached((str(tmp_path / "nvidia[0-9]*"),))
    assert not platform.accelerator_attached((str(tmp_path / "kfd"), str(tmp_path / "accel[0-9]*")))
    env = {}
    platform.choose_platforms(env)
    assert env == ({} if platform.accelerator_attached() else {"JAX_PLATFORMS": "cpu"})
    env = {"JAX_PLATFORMS": ""}                  # the user's choice, even an empty one, is kept
    platform.choose_platforms(env)
    assert env == {"JAX_PLATFORMS": ""}


@pytest.mark.parametrize("flags,words", [(["--budget", "-3"], ["budget", ">= 0"]), (["--budget", "wide"], ["--budget", "auto"]), (["--max-new-tokens", "0"], ["max_new_tokens", ">= 1"]),
                                         (["--method", "beam"], ["invalid choice"]), (["--temperature", "x"], ["invalid float"]),
                                         (["--seed", "-1"], ["seed", "uint32", "got -1"]),
                                         (["--seed", "4294967296"], ["seed", "[0, 4294967295]", "got 4294967296"]),
                                         (["--top-p", "0"], ["top_p", "(0, 1]"]),
                                         (["--logit-bias", "{5: 1}"], ["--logit-bias", "JSON"]),
                                         (["--logit-bias", '{"x": 1}'], ["logit_bias", "token ids"]),
                                         (["--json-schema", "/nonexistent.json"], ["--json-schema", "cannot read"]),
                                         (["--json-object", "--regex", "a"], ["not allowed with"])])
def test_bad_flag_values(flags, words, decode):
    one_line_error(decode(*flags), *words)


def _prompt_file(kind, tmp_path):
    if kind == "not UTF-8":
        f = tmp_path / "latin1.py"
        f.write_bytes('def f():\n    return "café"\n'.encode("latin-1"))
        return str(f)
    if kind == "a directory":
        return str(tmp_path)
    if kind == "missing":
        return str(tmp_path / "missing.py")
    if kind == "a socket":                                      # open() fails even for root: ENXIO
        path = str(tmp_path / "prompt.sock")
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(path)                                    # the file stays after the socket closes
        return path
    f = tmp_path / "secret.py"                                 # unreadable
    f.write_text("x = 1\n")
    f.chmod(0)
    return str(f)


@pytest.mark.parametrize("kind,words", [
    ("not UTF-8", ["is not UTF-8 text (byte 0xe9 at offset 24)"]), ("a directory", ["is a directory"]),
    ("missing", ["does not exist"]), ("a socket", ["cannot be read: No such device or address"]),
    pytest.param("unreadable", ["cannot be read: Permission denied"],
                 marks=pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file"))])
def test_bad_prompt_file_is_one_line_naming_it(tmp_path, kind, words, decode):
    path = _prompt_file(kind, tmp_path)
    one_line_error(decode("--prompt-file", path), f"prompt file {path!r}", *words)


def test_a_door_without_its_extra_names_the_extra():
    """``python -m kimi_jax.serve`` where the serve extra is missing (its h11 hidden from the import system): one
    line naming the extra to install, status 2, no traceback, before any model loads."""
    script = ("import runpy, sys; sys.modules['h11'] = None; sys.argv = ['kimi_jax.serve']; "
              "runpy.run_module('kimi_jax.serve', run_name='__main__')")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=cpu_env())
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines() == ["kimi_jax.serve: error: it needs h11, from the serve extra: pip install "
                                       "'kimi-jax[serve]' (in a checkout: .venv/bin/pip install -e '.[serve]')"]


@pytest.mark.parametrize("flags", [["--seed", "-1"], ["--prompt-file", "/"]])
def test_bad_input_fails_before_jax_loads(flags):
    """A bad flag or prompt file is reported without importing JAX (seconds on a cold start), or any model."""
    script = f"import sys; from kimi_jax.cli.decode import main; print(main({flags!r}), 'jax' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.stdout.split() == ["1", "False"], res.stdout + res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


STATS = {"new_tokens": 24, "tokens_per_s": 31.26, "mean_tau": 2.5, "rounds": 10, "width_per_round": [0, 8, 8, 16],
         "dispatches": 1}


@pytest.mark.parametrize("extra,line", [
    ({}, "[24 new tokens, 31.3 tok/s, mean tau 2.50, 10 rounds, widths 0x1 8x2 16x1, 1 dispatches]"),
    ({"compile_s": 3.21}, ("[24 new tokens, 31.3 tok/s, mean tau 2.50, 10 rounds, widths 0x1 8x2 16x1, "
                           "1 dispatches, compiled in 3.2 s]")),
    ({"compile_s": 0.0}, "[24 new tokens, 31.3 tok/s, mean tau 2.50, 10 rounds, widths 0x1 8x2 16x1, 1 dispatches]"),
    ({"width_per_round": [], "drafter": "off (calibrated)", "compile_s": 12.04},
     ("[24 new tokens, 31.3 tok/s, mean tau 2.50, 10 rounds, drafter off (calibrated), 1 dispatches, "
      "compiled in 12.0 s]")),
])
def test_stats_line(extra, line):
    assert _stats_line({**STATS, **extra}) == line


@needs_default
def test_drafter_that_does_not_fit(tmp_path, decode):
    cfg = json.loads((DRAFTER / "drafter_config.json").read_text())
    bad = tmp_path / "drafter"
    bad.mkdir()
    os.symlink(DRAFTER / "params", bad / "params")
    (bad / "drafter_config.json").write_text(json.dumps({**cfg, "vocab_size": cfg["vocab_size"] + 1}))
    one_line_error(decode("--drafter", str(bad), "--max-new-tokens", "4"), "vocab_size")


@needs_default
def test_prompt_longer_than_context(tmp_path, decode):
    long_prompt = tmp_path / "p.py"
    long_prompt.write_text("x = 1\n" * 3000)
    one_line_error(decode("--prompt-file", str(long_prompt), "--max-new-tokens", "4"), "context")


def test_mesh_larger_than_the_devices(decode):
    one_line_error(decode("--mesh", "ep=16", "--method", "ar", "--max-new-tokens", "4"), "needs 16 devices")


# ---- damaged checkpoints and Ctrl-C ----------------------------------------------------------------------------

def _largest_weight_file(ckpt):
    files = [p for p in (ckpt / "params").rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def _damage(kind, copy):
    f = _largest_weight_file(copy)
    if kind == "truncated":
        os.truncate(f, f.stat().st_size // 2)
    elif kind == "emptied":
        os.truncate(f, 0)
    elif kind == "deleted":
        f.unlink()
    elif kind == "bit flip":                            # same size: only the checksum can tell
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    elif kind == "bad manifest":
        (copy / "manifest.json").write_text('{"format": "kimi_jax-manifest-1", "files": {"params/x": ')
    return f


DAMAGE = ["truncated", "emptied", "deleted", "bit flip", "bad manifest"]


@needs_default
@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_checkpoint_api_names_the_file(tmp_path, kind):
    from kimi_jax.weights.checkpoint import CheckpointError
    copy = tmp_path / "target"
    shutil.copytree(TARGET, copy)
    f = _damage(kind, copy)
    named = "manifest.json" if kind == "bad manifest" else f.name
    with pytest.raises(CheckpointError, match=named):
        kimi_jax.load(str(copy))


@needs_default
def test_failed_restore_leaves_no_reports_behind(tmp_path):
    """A failed orbax restore leaves reads running in tensorstore's threads; their reports (closed event loop,
    never-retrieved failure, never-awaited orbax coroutine) must not reach stderr, while unrelated ones still do."""
    copy = tmp_path / "target"
    shutil.copytree(TARGET, copy)
    _damage("truncated", copy)
    script = f"""
import gc, sys, time
from kimi_jax.weights.checkpoint import CheckpointError, restore_tree
for _ in range(4):
    try:
        restore_tree({str(copy / "params")!r})
    except CheckpointError:
        print("failed as expected", file=sys.stderr)
time.sleep(1.0)                                   # the stragglers finish after the restores returned
class Unrelated:
    def __del__(self):
        raise ValueError("unrelated failure")
Unrelated()
async def unawaited_elsewhere():
    pass
unawaited_elsewhere()
gc.collect()
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=ROOT)
    assert res.stderr.count("failed as expected") == 4, res.stderr
    assert "Event loop is closed" not in res.stderr and "never retrieved" not in res.stderr, res.stderr
    assert res.stderr.count("was never awaited") == 1 and "unawaited_elsewhere" in res.stderr, res.stderr
    assert "unrelated failure" in res.stderr, res.stderr


@needs_default
def test_restore_leaves_the_process_hooks_as_they_were(tmp_path):
    """The silencer of abandoned reads lives as long as one read: after a restore, and after a failed one, the
    process's unraisable hook, warning display and asyncio log filters are the ones it had before."""
    import logging
    import warnings

    from kimi_jax.weights.checkpoint import CheckpointError, restore_tree

    def hooks():
        return sys.unraisablehook, warnings.showwarning, list(logging.getLogger("asyncio").filters)

    copy = tmp_path / "target"
    shutil.copytree(TARGET, copy)
    before = hooks()
    restore_tree(str(TARGET / "params"))
    assert hooks() == before
    _damage("truncated", copy)
    with pytest.raises(CheckpointError, match="damaged or incomplete"):
        restore_tree(str(copy / "params"))
    assert hooks() == before


@needs_default
@pytest.mark.slow
@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_checkpoint_cli_is_one_line(tmp_path, kind, decode):
    copy = tmp_path / "target"
    shutil.copytree(TARGET, copy)
    f = _damage(kind, copy)
    res = decode("--checkpoint", str(copy), "--drafter", "none", "--max-new-tokens", "2")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    one_line_error(res, "manifest.json" if kind == "bad manifest" else f.name, "damaged" if kind != "deleted"
                   else "missing")


@needs_default
@pytest.mark.slow
def test_damaged_checkpoint_without_manifest_cli_is_the_note_and_one_error(tmp_path, decode):
    """A checkpoint from before manifests: the one-time note, then orbax's failure as one line, no traceback."""
    copy = tmp_path / "target"
    shutil.copytree(TARGET, copy)
    (copy / "manifest.json").unlink()
    _damage("truncated", copy)
    res = decode("--checkpoint", str(copy), "--drafter", "none", "--max-new-tokens", "2")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and "Traceback" not in res.stderr and len(lines) == 2, res.stderr
    assert "has no manifest.json" in lines[0] and "orbax checkpoint" in lines[1] and "damaged" in lines[1]


@needs_default
def test_checkpoint_without_manifest_loads_with_one_note(tmp_path, capfd):
    """Written before manifests: still loads, and says once that nothing was checked."""
    copy = tmp_path / "target"
    shutil.copytree(TARGET, copy)
    (copy / "manifest.json").unlink()
    a, b = kimi_jax.load(str(copy)), kimi_jax.load(str(copy))
    assert capfd.readouterr().err.count("has no manifest.json") == 1
    assert np.array_equal(a.logits([1, 2, 3]), b.logits([1, 2, 3]))
    assert np.array_equal(a.logits([1, 2, 3]), kimi_jax.load(str(TARGET)).logits([1, 2, 3]))
    # (its damage surfaces from orbax as a CheckpointError: tests/test_model.py, test_damaged_weight_file_...)


@needs_default
def test_verify_flag_checksums_large_checkpoints(tmp_path, monkeypatch):
    """Above HASH_ALWAYS_BYTES only sizes are checked unless verify=True asks for the checksums."""
    from kimi_jax.weights import checkpoint
    copy = tmp_path / "target"
    shutil.copytree(TARGET, copy)
    _damage("bit flip", copy)
    monkeypatch.setattr(checkpoint, "HASH_ALWAYS_BYTES", 0)
    checkpoint.check_manifest(str(copy))                              # sizes only: passes
    with pytest.raises(checkpoint.CheckpointError, match="checksum"):
        checkpoint.check_manifest(str(copy), verify=True)


def _wakeup_fd() -> int:
    fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(fd)
    return fd


@pytest.fixture
def sigint_handler():
    """Python's own SIGINT handler for the test, as under an interactive shell: a run started in the background by
    a non-interactive shell inherits SIGINT ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_an_ignored_ctrl_c_stays_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        seen = []
        assert run_command("t", lambda: seen.append((_wakeup_fd(), signal.getsignal(signal.SIGINT)))) == 0
        assert seen == [(-1, signal.SIG_IGN)] and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_ctrl_c_watch_is_undone_when_the_command_returns(sigint_handler):
    seen = []
    handler = signal.getsignal(signal.SIGINT)
    assert run_command("t", lambda: seen.append((_wakeup_fd(), signal.getsignal(signal.SIGINT)))) == 0
    assert seen[0][0] != -1 and seen[0][1] is not handler
    assert _wakeup_fd() == -1 and signal.getsignal(signal.SIGINT) is handler
    deadline = time.monotonic() + 5
    while any(t.name == "kimi_jax ctrl-c" for t in threading.enumerate()):     # it reads end-of-file and stops
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_ctrl_c_leaves_an_event_loops_wakeup_fd_alone():
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end)
    try:
        seen = []
        run_command("t", lambda: seen.append(_wakeup_fd()))
        assert seen == [write_end] and _wakeup_fd() == write_end
    finally:
        signal.set_wakeup_fd(-1)
        os.close(read_end)
        os.close(write_end)


def test_ctrl_c_defers_to_a_handler_installed_inside_the_command():
    """A server (uvicorn under `python -m kimi_jax.serve`) installs its own SIGINT handler to drain its requests
    first, then re-raises the signal to the handler it found: the drain runs, then one line and status 130."""
    script = """
import os, signal, time
from kimi_jax.cli.exits import exit_with, run_command
signal.signal(signal.SIGINT, signal.default_int_handler)   # a terminal's, not a background shell's SIG_IGN
def serve():
    drained = []
    ours = signal.signal(signal.SIGINT, lambda *_: drained.append(True))
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)                          # long enough for the watching thread to read the signal
    print("drained", drained, flush=True)
    signal.signal(signal.SIGINT, ours)
    signal.raise_signal(signal.SIGINT)       # ours now: the handler and the watching thread both see it
    time.sleep(10)
exit_with(run_command("t", serve))
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 130 and res.stdout == "drained [True]\n", res
    assert res.stderr == "t: interrupted\n", res.stderr


@needs_default
@pytest.mark.slow
def test_sigint_during_decode_exits_130_with_one_line():
    env = cpu_env()
    p = subprocess.Popen([sys.executable, "-m", "kimi_jax.decode", "--max-new-tokens", "400"], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    time.sleep(3.0)
    t0 = time.perf_counter()
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and time.perf_counter() - t0 < 2
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "kimi_jax.decode: interrupted", err


@needs_default
@pytest.mark.slow
def test_sigint_mid_compile_exits_at_once(tmp_path):
    """An empty compile cache, so the generation program compiles (seconds, in C++, holding the main thread); XLA's
    HLO dump marks the compile's start (before_optimizations) and end (after_optimizations)."""
    dump = tmp_path / "xla"
    env = cpu_env()
    env.update(XLA_FLAGS=f"{env['XLA_FLAGS']} --xla_dump_to={dump}", KIMI_JAX_CACHE=str(tmp_path / "cache"))
    p = subprocess.Popen([sys.executable, "-m", "kimi_jax.decode"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    deadline = time.monotonic() + 120
    while not list(dump.glob("*generate_program.before_optimizations.txt")):
        assert p.poll() is None and time.monotonic() < deadline, "the generation program never started compiling"
        time.sleep(0.05)
    time.sleep(0.5)                                      # well inside the compile
    t0 = time.perf_counter()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    latency = time.perf_counter() - t0
    assert p.returncode == 130 and latency < 2, (p.returncode, latency)
    assert not list(dump.glob("*generate_program.cpu_after_optimizations.txt")), "the compile was over: no test"
    assert out == "" and err == "kimi_jax.decode: interrupted\n", err
