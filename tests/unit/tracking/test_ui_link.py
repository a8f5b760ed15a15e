"""The link a run's summary prints opens MLflow's model-training view: MLflow 3's UI, served by
a real `mlflow server`, in a headless Chromium (Debian's `chromium` and `chromedriver`, which
`.ci/run` installs); a screenshot of the page is kept with the test's files. Without the link's
`workflowType`, the same page opens in the GenAI view users met ("Traces", "Evaluations")."""

from __future__ import annotations

import itertools
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
    """The page's text once `waits_for` shows (the UI renders after its scripts load), loaded
    afresh (not a change of the address's fragment inside the page)."""
    driver.get("about:blank")
    driver.get(url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = driver.find_element("tag name", "body").text
        if waits_for in text.splitlines():
            time.sleep(1.0)  # the navigation renders beside the run
            return driver.find_element("tag name", "body").text
        time.sleep(0.5)
    raise AssertionError(f"{url}: {waits_for!r} never showed in {text[-3000:]!r}")


def recorded_run(uri: str, experiment: str, name: str, records: list[dict]) -> tuple[dict, dict]:
    """A run logged by the sink with the contract params and `records`: (its params, the
    summary's links by what they open)."""
    from rich.console import Console

    from rayacc.config import TrainConfig
    from rayacc.config.batch_split import BatchSplit
    from rayacc.driver.fit import FitResult
    from rayacc.observe.console import summary_lines
    from rayacc.tracking.mlflow_sink import MlflowSink
    from rayacc.tracking.params import contract_params

    cfg = TrainConfig.from_dict({"batch": {"global_batch_size": 8, "micro_batch_size": 4}})
    params = contract_params(cfg, cfg.batch_split(), 1e-3)
    sink = MlflowSink(uri, experiment, name)  # an experiment of its own
    sink.log_params(params)
    sink.log_step_metrics(records)
    sink.finish()
    run = MlflowClient(uri).get_run(sink.run_id)
    result = FitResult(
        checkpoint_dir="ckpt", mlflow_run_id=sink.run_id, metrics={},
        split=BatchSplit(8, 4, 1, 2), effective_lr=1e-3, run_name="r", storage_path=".",
        tracking_uri=uri, mlflow_experiment_id=run.info.experiment_id, wall_time_s=1.0,
    )  # fmt: skip
    console = Console(record=True, width=400)
    for line in summary_lines(cfg, result):
        console.print(line)
    lines = [line.strip().split(": http", 1) for line in console.export_text().splitlines()]
    links = {line[0]: "http" + line[1] for line in lines if len(line) == 2}
    return params, links


def test_the_printed_link_opens_the_model_training_view(mlflow_server, tmp_path, browser):
    records = [{"step": s, "train/loss": 1.0 / s} for s in (1, 2, 3)]
    uri = f"http://127.0.0.1:{mlflow_server}"
    params, links = recorded_run(uri, f"ui-{tmp_path.name}", "ui-link-run", records)
    link = links["open the UI"]

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


SECTIONS = ("comm", "data", "goodput", "mem", "perf", "rank_0", "ranks", "scaling", "train", "val")
"""A section of each kind a run logs (the diagnostics sort before the loss by name)."""


def sections_in(text: str) -> list[str]:
    """The chart sections a page shows, in its order (a section's name, then its count)."""
    lines = text.splitlines()
    return [a for a, b in itertools.pairwise(lines) if a in SECTIONS and b.startswith("(")]


def test_the_printed_charts_link_opens_the_loss_first_and_the_table_its_batch(
    mlflow_server, tmp_path, browser
):
    keys = [f"{section}/x" for section in SECTIONS] + ["train/loss", "val/loss"]
    records = [{"step": s, **{k: 1.0 / s for k in keys}} for s in (1, 2, 3)]
    uri = f"http://127.0.0.1:{mlflow_server}"
    _, links = recorded_run(uri, f"view-{tmp_path.name}", "loss-first-run", records)
    charts = links["the experiment's runs charted, loss first"]
    browser.set_window_size(2600, 1100)  # every column of the table on the screen

    order = sections_in(page_text(browser, charts, "train/loss"))
    browser.save_screenshot(str(tmp_path / "charts_loss_first.png"))
    assert order[:3] == ["train", "val", "scaling"], order
    assert set(order) == set(SECTIONS), order  # every section shown, the diagnostics behind
    # the same charts without the saved view: MLflow's order by name (the check tells them apart)
    plain = charts.replace("viewStateShareKey=rayacc-loss-first&", "")
    assert sections_in(page_text(browser, plain, "comm/x"))[0] == "comm"

    # the table of the same view: the batch, the LR and the last loss of each run
    browser.delete_all_cookies()
    browser.execute_script("window.localStorage.clear()")
    text = page_text(browser, charts.replace("&compareRunsMode=CHART", ""), "loss-first-run")
    browser.save_screenshot(str(tmp_path / "table_loss_first.png"))
    lines = text.splitlines()
    assert {"global_batch_size", "effective_lr", "train/loss", "val/loss"} <= set(lines), text
    assert "8" in lines and "0.001" in lines and "0.3333" in " ".join(lines), text
