"""The link a run's summary prints opens MLflow's model-training view: MLflow 3's UI, served by
a real `mlflow server`, in a headless Chromium (Debian's `chromium` and `chromedriver`, which
`.ci/run` installs); a screenshot of the page is kept with the test's files. Without the link's
`workflowType`, the same page opens in the GenAI view users met ("Traces", "Evaluations")."""

from __future__ import annotations

import os
import shutil
import time

import pytest
from mlflow.tracking import MlflowClient

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture
def browser():
    if not (CHROMIUM and DRIVER):
        if os.environ.get("CI"):
            pytest.fail("chromium and chromedriver are not installed (.ci/run installs them)")
        pytest.skip("no chromium and chromedriver here (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,900"):  # fmt: skip
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


def page_text(driver, url: str, waits_for: str, timeout_s: float = 60.0) -> str:
    """The page's text once `waits_for` shows (the UI renders after its scripts load)."""
    driver.get(url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = driver.find_element("tag name", "body").text
        if waits_for in text:
            time.sleep(1.0)  # the navigation renders beside the run
            return driver.find_element("tag name", "body").text
        time.sleep(0.5)
    raise AssertionError(f"{url}: {waits_for!r} never showed")


def test_the_printed_link_opens_the_model_training_view(mlflow_server, tmp_path, browser):
    from rich.console import Console

    from rayacc.config import TrainConfig
    from rayacc.config.batch_split import BatchSplit
    from rayacc.driver.fit import FitResult
    from rayacc.observe.console import summary_lines
    from rayacc.tracking.mlflow_sink import MlflowSink
    from rayacc.tracking.params import contract_params

    uri = f"http://127.0.0.1:{mlflow_server}"
    cfg = TrainConfig.from_dict({"batch": {"global_batch_size": 8, "micro_batch_size": 4}})
    params = contract_params(cfg, cfg.batch_split(), 1e-3)
    sink = MlflowSink(uri, f"ui-{tmp_path.name}", "ui-link-run")  # an experiment of its own
    sink.log_params(params)
    sink.log_step_metrics([{"step": s, "train/loss": 1.0 / s} for s in (1, 2, 3)])
    sink.finish()
    run = MlflowClient(uri).get_run(sink.run_id)
    result = FitResult(
        checkpoint_dir=str(tmp_path / "ckpt"), mlflow_run_id=sink.run_id, metrics={},
        split=BatchSplit(8, 4, 1, 2), effective_lr=1e-3, run_name="r",
        storage_path=str(tmp_path), tracking_uri=uri,
        mlflow_experiment_id=run.info.experiment_id, wall_time_s=1.0,
    )  # fmt: skip
    console = Console(record=True, width=300)
    for line in summary_lines(cfg, result):
        console.print(line)
    (link,) = [w for w in console.export_text().split() if w.startswith(f"{uri}/#/")]

    text = page_text(browser, link, "ui-link-run")
    shot = tmp_path / "model_training_view.png"
    browser.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = set(text.splitlines())
    # the model-training view: its navigation (runs, models, the registry) and the run's tabs
    assert {"Runs", "Models", "Model registry", "Model metrics", "System metrics"} <= lines, text
    assert not {"Evaluations", "Judges", "Sessions"} & lines, text
    # the run's params as the page lists them: the contract's first, in the order logged
    shown = [line for line in text.splitlines() if line in params]
    assert shown[:10] == list(params)[:10], shown
    # the same page without the link's query: the GenAI view (the check can tell them apart)
    plain = page_text(browser, link.split("?")[0], "ui-link-run")
    assert {"Evaluations", "Judges"} <= set(plain.splitlines()), plain
