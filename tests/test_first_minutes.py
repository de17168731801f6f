"""A new user's first minutes: a mistyped key gets mpexp's one message, a run's last line says
what it reached and where, a sweep job's folder is named by its overrides and can be resumed
from, and the getting-started page shows what the quickstart prints and the commands the package
installs."""

from __future__ import annotations

import json
import re

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from mpexp.config import SimpleCNNConfig
from mpexp.errors import ConfigError
from mpexp.resolvers import quote_run_dirs
from mpexp.run.last_line import last_line
from mpexp.tasks.language_model import LanguageModelling
from mpexp.validate import check_schema
from tests.conftest import ROOT, make_cfg, one_line_failure

GETTING_STARTED = ROOT / "docs" / "getting-started.md"


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["precison=bf16"], "precison (did you mean precision?)"),
        (["trainer.epoch=1"], "trainer.epoch (did you mean trainer.epochs?)"),
        (["model=gpt", "model.n_layr=2"], "model.n_layr (did you mean model.n_layer?)"),
    ],
)
def test_a_mistyped_key_gets_one_message_naming_the_key_it_meant(in_process, tmp_path,
                                                                overrides, said):  # fmt: skip
    output = one_line_failure(in_process("experiment=quickstart", *overrides, cwd=tmp_path))
    # one line: Hydra's "Could not override" and its advice to add the key with + are gone
    assert re.fullmatch(
        rf"Unknown config key: {re.escape(said)}\. `(mpexp-train|python -m mpexp\.train) "
        r"--cfg job` lists every key\.",
        output.strip(),
    ), output
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["precision=bf61"], "precision=bf61 is none of precision's options: bf16, "),
        # a preset misspelt trained the defaults without a word while the group was optional
        (["experiment=gpt2smal"], "experiment=gpt2smal is none of experiment's options: "),
        (["-m", "model=resnt50,vit"], "model=resnt50 is none of model's options: "),
    ],
)
def test_a_mistyped_option_gets_one_message_naming_the_closest(in_process, tmp_path, overrides,
                                                               said):  # fmt: skip
    result = in_process(*overrides, "trainer.epochs=1", "wandb.mode=disabled", cwd=tmp_path)
    output = one_line_failure(result).strip()
    closest = {"precision": "bf16", "experiment": "gpt2_small", "model": "resnet50"}
    group = said.split("=", 1)[0]
    assert output.startswith(said) and output.endswith(f"The closest: {closest[group]}."), output
    assert "\n" not in output and result.returncode == 2
    jobs = [p for p in (tmp_path / "outputs").rglob("*") if p.name[:2] in ("0_", "1_")]
    assert jobs == [] and not list((tmp_path / "outputs").rglob("*.log"))  # nothing started


def test_a_schema_may_accept_keys_of_its_own(in_process, tmp_path, monkeypatch):
    """A model option whose schema says it takes a key (as one handing its keys to another
    library's config would) gets `model.<key>=value` added, and no check calls it unknown."""
    with pytest.raises(ConfigError, match=r"Unknown config key: model\.extra"):
        check_schema(make_cfg("experiment=quickstart", "++model.extra=3"))
    accepts = classmethod(lambda cls, key: key == "extra")
    monkeypatch.setattr(SimpleCNNConfig, "accepts_key", accepts, raising=False)
    result = in_process("--cfg", "job", "experiment=quickstart", "model.extra=3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "  extra: 3\n" in result.stdout
    check_schema(make_cfg("experiment=quickstart", "++model.extra=3"))  # accepted


def test_a_sweep_jobs_folder_is_taken_by_trainer_resume_as_it_is_named(tmp_path):
    job = tmp_path / "0_precision=fp32,trainer.seed=0"
    job.mkdir()
    (given,) = quote_run_dirs([f"trainer.resume={job}"])
    (parsed,) = OverridesParser.create().parse_overrides([given])
    assert parsed.value() == str(job) and not parsed.is_sweep_override()
    # a path that is not there is left to Hydra (and to RunChecks' message)
    assert quote_run_dirs(["trainer.resume=nowhere"]) == ["trainer.resume=nowhere"]


def shape(line: str) -> str:
    """A console line's shape: its message without the time, numbers as N, the CPU's name and
    the run's folder as placeholders."""
    message = line.split("] - ", 1)[1] if "] - " in line else line
    message = re.sub(r"parameters on [^|]+\|", "parameters on <device> |", message)
    message = re.sub(r"outputs/\S+", "outputs/<date>/<time>", message)
    return re.sub(r"\d[\d,.]*", "N", message)


def documented_run() -> tuple[str, str]:
    """The first and last lines of the quickstart's output as getting-started.md shows them
    (tests/test_report.py holds them against a sweep's jobs, which print the same)."""
    sample = GETTING_STARTED.read_text().split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    return sample[0], sample[-1]


def test_the_commands_the_docs_name_are_those_the_package_installs():
    # [project.scripts]' names, read without tomllib (Python 3.11's; mpexp runs on 3.10)
    section = (ROOT / "pyproject.toml").read_text().split("[project.scripts]\n", 1)[1]
    scripts = set(re.findall(r"^([\w-]+) = ", section.split("\n[", 1)[0], re.MULTILINE))
    assert "mpexp-train" in scripts and "mpexp-report" in scripts
    text = GETTING_STARTED.read_text()
    installs = text.split("It installs", 1)[1].split("\n\n", 1)[0]
    assert set(re.findall(r"`(mpexp-[a-z]+)`", installs)) == scripts
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        named = set(re.findall(r"\bmpexp-[a-z]+\b", page.read_text()))
        assert named <= scripts, f"{page.name} names {named - scripts}, which no script installs"


def test_a_runs_last_line_names_its_result_final_and_best_its_time_and_folder(tmp_path):
    """A language model trained to a step budget, validated twice: its loss got worse at the
    end, so the best is not the last."""
    rows = [
        {"step": 4, "train/loss": 3.1},
        {"epoch": 1, "step": 4, "val/loss": 2.5, "perf/epoch_time_s": 1.5, "perf/compile_s": 0.5},
        {"epoch": 1, "step": 8, "val/loss": 2.75, "perf/epoch_time_s": 1.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"ran": {"task": LanguageModelling.result.record()}, "val/loss": 2.75, "step": 8,
               "epoch": 1}  # fmt: skip
    assert last_line(str(tmp_path), summary, 7.25, by_steps=True) == (  # as Python may give it
        "Done: val/loss 2.7500 nats (best 2.5000 nats at step 4) | 8 steps, 3.0 s of training "
        f"(this command: 7.2 s) | {tmp_path}"
    )
