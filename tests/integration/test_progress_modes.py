"""The progress a fit shows follows where the program runs: a spark-submit job whose stderr
is a file gets lines, a Jupyter kernel without ipywidgets a text bar, whatever is imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.spark  # each starts a Spark driver of its own (about 40 s)
SCRIPT = Path(__file__).parent / "scripts" / "job_progress.py"
ROOT = Path(__file__).parents[2]


@pytest.mark.slow  # a spark-submit job, as the other spark-submit tests
def test_a_spark_submit_job_with_ipykernel_imported_logs_lines_not_a_bar(tmp_path):
    log_file = tmp_path / "driver.log"  # spark-submit merges the Python driver's stderr into its stdout
    with log_file.open("w") as log:
        done = subprocess.run([str(Path(sys.executable).parent / "spark-submit"), "--master", "local[2]", str(SCRIPT)],
                              stdout=log, stderr=subprocess.STDOUT, timeout=400, cwd=tmp_path,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
    text = log_file.read_text()
    assert done.returncode == 0, text[-3000:]
    assert "FITTED 48" in text
    assert "\r" not in text, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith("spark_torch_est: ")]
    assert lines[0] == "spark_torch_est: checking the DataFrame, the Params and the model ...", text[-3000:]
    assert any(line.startswith("spark_torch_est: launching 2 ranks") for line in lines), lines
    assert any(line.startswith("spark_torch_est: first step after ") for line in lines), lines
    assert sum(" of this fit, epoch " in line for line in lines) >= 2, lines  # a line a second while steps run


@pytest.mark.slow  # a notebook kernel of its own: about 20 s
def test_a_notebook_without_ipywidgets_shows_a_text_bar_and_no_warning(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.v4.new_notebook()
    notebook.cells.append(nbformat.v4.new_code_cell(SCRIPT.read_text()))
    nbclient.NotebookClient(notebook, timeout=400, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute(
        env=dict(os.environ, PYTHONPATH=str(ROOT)))
    outputs = notebook.cells[0].outputs
    text = "".join(output.get("text", "") for output in outputs)
    assert "FITTED 48" in text, outputs
    assert "IProgress" not in text and "TqdmWarning" not in text, text[-3000:]
    stderr = "".join(output.get("text", "") for output in outputs if output.get("name") == "stderr")
    assert "launching 2 ranks" in stderr and "training: 100%" in stderr and "48/48" in stderr, stderr[-3000:]
