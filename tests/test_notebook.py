"""Execute notebooks/quickstart.ipynb end to end so it cannot rot.

The kernel is the "python3" kernelspec, which jupyter_client launches with this interpreter (sys.executable), on
the CPU, importing kimi_jax from this checkout. Skipped until the bundled checkpoints exist.
"""

import os
import pathlib
import time

import pytest
from conftest import cpu_env

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
TARGET = ROOT / "checkpoints" / "target"
DRAFTER = ROOT / "checkpoints" / "drafter"


def _kernel_name(tmp_path, monkeypatch) -> str:
    """"python3" when a kernelspec of that name is visible, else one written to a temp dir (nothing global)."""
    import json
    import sys

    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec("python3")
        return "python3"
    except NoSuchKernel:
        spec_dir = tmp_path / "jupyter" / "kernels" / "kimi-jax-test"
        spec_dir.mkdir(parents=True)
        (spec_dir / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "kimi_jax test", "language": "python"}))
        monkeypatch.setenv("JUPYTER_PATH", os.pathsep.join(filter(None, [str(tmp_path / "jupyter"),
                                                                         os.environ.get("JUPYTER_PATH")])))
        return "kimi-jax-test"


def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    if not (TARGET / "kimi_config.json").exists():
        pytest.skip(f"the bundled target checkpoint is missing: {TARGET}/kimi_config.json")
    if not (DRAFTER / "drafter_config.json").exists():
        pytest.skip(f"the bundled drafter checkpoint is missing: {DRAFTER}/drafter_config.json "
                    "(python -m kimi_jax.training.drafter writes it)")
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel", reason="the notebook kernel needs ipykernel in this environment")
    pytest.importorskip("matplotlib")

    # The kernel inherits os.environ: CPU only, kimi_jax from this checkout, the committed checkpoint paths,
    # and not the 8 fake host devices conftest.py asks for (the notebook runs on one device).
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("XLA_FLAGS", cpu_env()["XLA_FLAGS"])
    monkeypatch.delenv("KIMI_JAX_TARGET", raising=False)
    monkeypatch.delenv("KIMI_JAX_DRAFTER", raising=False)

    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
        "commit the notebook without outputs (jupyter nbconvert --clear-output --inplace)"
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name=_kernel_name(tmp_path, monkeypatch),
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    t0 = time.perf_counter()
    client.execute()            # raises CellExecutionError (with the cell's traceback) when a cell fails
    wall = time.perf_counter() - t0

    code = [c for c in nb.cells if c.cell_type == "code"]
    text = "".join(o.get("text", "") for c in code for o in c.outputs if o.get("output_type") == "stream")
    assert "identical:" in text                                               # the losslessness cell ran
    images = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 2, "expected the acceptance histogram and the tree drawing"
    print(f"quickstart.ipynb executed in {wall:.0f}s")
