"""Two local processes x 4 CPU devices form one 8-device mesh (jax.distributed) and decode like one process;
``python -m kimi_jax.decode`` joins such a run from its flags (``kimi_jax.cli.cluster``), and a process that dies
ends the others instead of leaving them in a collective.

Run as a worker: ``python tests/test_multihost.py WORKER PROCESS_ID PORT`` (what the test launches twice).
The worker first checks that a cross-process psum works (the CPU backend needs gloo collectives); if that
fails, the test skips with the reason instead of failing.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[5, 17, 33, 2, 9, 100, 41], [7, 7, 200, 3, 64, 12, 90]]
MAX_NEW = 8


def _cfg():
    from kimi_jax.config import TINY
    return TINY.replace(num_attention_heads=8)          # float experts; 8 heads split over tp=8


def _params(cfg):
    import jax

    from kimi_jax.model import params as params_lib
    return params_lib.init_params(cfg, jax.random.key(0))


def worker(process_id: int, port: int) -> None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    import jax
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=60)
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import kimi_jax
    from kimi_jax import sharding as part
    from kimi_jax.model.params import shard_params

    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = part.make_mesh("tp=8")                        # spans both processes' devices
    x = jax.make_array_from_callback((8,), NamedSharding(mesh, P("tp")),
                                     lambda idx: np.arange(8, dtype=np.float32)[idx])
    total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P()))(x)
    assert float(np.asarray(total)) == 28.0
    print("PSUM_OK", flush=True)

    cfg = _cfg()
    # Every process builds the same host weights and contributes its own devices' shards.
    params = jax.device_get(_params(cfg))
    sharded = shard_params(params, cfg, mesh, "tp")
    out = kimi_jax.Model(cfg, sharded, mesh=mesh).generate(PROMPTS, max_new_tokens=MAX_NEW, method="ar")
    print("TOKENS " + json.dumps(out.tokens), flush=True)
    jax.distributed.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_same_tokens_as_one():
    from conftest import cpu_env            # not at the top: the workers run this file as a script
    port = _free_port()
    env = {**cpu_env(), "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "WORKER", str(i), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
             for i in range(2)]
    # The one-process reference, computed while the workers compile.
    import kimi_jax
    cfg = _cfg()
    ref = kimi_jax.Model(cfg, _params(cfg)).generate(PROMPTS, max_new_tokens=MAX_NEW, method="ar").tokens
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0])
    except subprocess.TimeoutExpired:
        # One worker usually hangs in a collective because the other died: show both logs.
        for p in procs:
            p.kill()
        logs = [p.communicate()[0] for p in procs]
        pytest.fail("a worker timed out:\n" + "\n".join(f"--- process {i}:\n{o[-2000:]}" for i, o in enumerate(logs)))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if not all("PSUM_OK" in o for o in outs):
        pytest.skip("CPU multi-process collectives are unavailable in this jax build (a 2-process psum failed): "
                    + " | ".join(o.strip().splitlines()[-1][:300] if o.strip() else "no output" for o in outs))
    for i, (p, o) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i} failed:\n{o[-3000:]}"
        line = next(ln for ln in o.splitlines() if ln.startswith("TOKENS "))
        assert json.loads(line[len("TOKENS "):]) == ref, f"process {i} decoded differently from one process"


# ---- the decode command across processes ----------------------------------------------------------------------

HEARTBEAT_S = 5


def _decode_processes(n: int, devices_each: int, *flags, tmp_path):
    """``n`` processes of ``python -m kimi_jax.decode`` joined on a local coordinator, ``devices_each`` CPU devices
    each -> (processes, their stdout paths, their stderr paths)."""
    from conftest import cpu_env
    port = _free_port()
    procs, outs, errs = [], [], []
    for i in range(n):
        outs.append(tmp_path / f"out{i}.txt")
        errs.append(tmp_path / f"err{i}.txt")
        # a cache directory of its own (cost tables; compiled programs stay shared), as on separate hosts
        env = {**cpu_env(devices_each), "KIMI_JAX_CACHE": str(tmp_path / f"cache{i}")}
        if "KIMI_JAX_CACHE" in os.environ:
            env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.environ["KIMI_JAX_CACHE"], "xla"))
        with open(outs[-1], "w") as out, open(errs[-1], "w") as err:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "kimi_jax.decode", "--coordinator", f"localhost:{port}", "--num-processes",
                 str(n), "--process-id", str(i), "--heartbeat-timeout", str(HEARTBEAT_S), *flags],
                cwd=ROOT, env=env, stdout=out, stderr=err))
    return procs, outs, errs


def _wait_all(procs, errs, timeout):
    try:
        return [p.wait(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("a process hung:\n" + "\n".join(f"--- {i}:\n{e.read_text()[-1500:]}" for i, e in enumerate(errs)))


@pytest.mark.parametrize("n,devices_each,budget", [(2, 2, "auto"), (4, 1, "8")])
def test_decode_command_across_processes_prints_what_one_process_decodes(n, devices_each, budget, tmp_path):
    """Every process runs the program on its devices of a global ep=4 mesh; process 0 prints the tokens one
    process decodes greedily (plain AR, here in this process), the others print nothing; all exit 0. Under the
    auto budget, with a cache directory each (as on separate hosts), the first run calibrates on every process
    in step and process 0 alone stores the table; the second run finds it on process 0's disk only (the
    follower's is emptied), and the follower takes it from process 0 instead of calibrating alone, in programs
    process 0 does not run."""
    import kimi_jax
    from kimi_jax.cli.decode import DEFAULT_DRAFTER, DEFAULT_PROMPT, DEFAULT_TARGET

    ref = kimi_jax.load(str(DEFAULT_TARGET), drafter=str(DEFAULT_DRAFTER)).generate(
        DEFAULT_PROMPT, max_new_tokens=24, method="ar").tokens[0]
    for attempt in range(2 if budget == "auto" else 1):
        shutil.rmtree(tmp_path / "cache1" / "costs", ignore_errors=True)     # the follower's disk: no table
        procs, outs, errs = _decode_processes(n, devices_each, "--mesh", "ep=4", "--budget", budget,
                                              "--max-new-tokens", "24", "--json", tmp_path=tmp_path)
        codes = _wait_all(procs, errs, timeout=300)
        assert codes == [0] * n, [e.read_text()[-1500:] for e in errs]
        assert json.loads(outs[0].read_text())["tokens"] == ref
        assert all(o.read_text() == "" for o in outs[1:])
        for i, e in enumerate(errs):
            assert f"process {i} of {n} joined ({devices_each} of 4 cpu devices here)" in e.read_text()
    if budget == "auto":
        assert list((tmp_path / "cache0" / "costs").glob("*.json"))
        assert not (tmp_path / "cache1" / "costs").exists()


def test_a_killed_follower_ends_the_run(tmp_path):
    """SIGKILL to process 1 mid-run: process 0 ends with a failure status within the heartbeat timeout (plus
    the time to notice), not in a collective for good."""
    procs, outs, errs = _decode_processes(2, 2, "--mesh", "ep=4", "--budget", "8", "--max-new-tokens", "900",
                                          tmp_path=tmp_path)
    deadline = time.monotonic() + 120
    while "joined" not in errs[1].read_text():
        assert time.monotonic() < deadline and procs[1].poll() is None, errs[1].read_text()[-1500:]
        time.sleep(0.2)
    time.sleep(2)                   # into loading and compiling
    procs[1].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    code = _wait_all(procs[:1], errs, timeout=HEARTBEAT_S + 60)[0]
    assert code != 0 and time.monotonic() - t0 < HEARTBEAT_S + 60
    assert "stopped sending heartbeats" in errs[0].read_text()
    procs[1].wait()


def test_a_mesh_that_leaves_devices_out_is_one_line_naming_what_fits(tmp_path):
    procs, outs, errs = _decode_processes(2, 2, "--mesh", "ep=2", tmp_path=tmp_path)
    codes = _wait_all(procs, errs, timeout=120)
    assert codes[0] == 1 and codes[1] != 0
    assert ("kimi_jax.decode: error: a run across 2 processes computes on all of their 4 devices, but mesh ep=2 "
            "covers 2; this model fits: ep=4") in errs[0].read_text().splitlines()


def test_the_flags_go_together(capsys):
    from kimi_jax.cli.decode import main
    with pytest.raises(SystemExit) as e:
        main(["--coordinator", "localhost:1234", "--num-processes", "2"])
    assert e.value.code == 2
    assert "--coordinator, --num-processes and --process-id go together" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--coordinator", "localhost:1234", "--num-processes", "2", "--process-id", "2"])
    assert "--process-id must be in [0, 2), got 2" in capsys.readouterr().err


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "WORKER":
    worker(int(sys.argv[2]), int(sys.argv[3]))
