"""End to end on a tiny model that memorised its data: BLADE raises the entropy of the forget answers while
the retain loss stays near epsilon; and the `blade unlearn` command around it."""

from __future__ import annotations

import json

import pytest
import torch

from blade_core.data import collate, load_tokenized
from blade_core.lora import load_with_stack
from blade_core.losses import token_cross_entropy
from blade_core.unlearn import run_unlearning
from blade_service.cli.main import main

pytestmark = pytest.mark.usefixtures("one_thread")

# Learning rates for a 30k-parameter model (the paper's are for 1-8B models), and one 4-row micro-batch a
# step (the reference's 16 rows would be most of this 6 + 24-row world); everything else is the default.
TINY = {"eta_out": 1e-3, "eta_in": 0.1, "batch_size": 4, "grad_accum": 1, "max_length": 64}


def _answer_loss(model, tokenizer, path) -> float:
    data = load_tokenized(path, tokenizer, 64)
    batch = collate([data[i] for i in range(len(data))], data.pad_id)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return token_cross_entropy(logits, batch["labels"]).item()


def test_blade_forgets_and_keeps_the_retain_loss_near_epsilon(engine_world, tmp_path):
    out = run_unlearning(
        model=engine_world.model,
        forget=engine_world.forget,
        retain=engine_world.retain,
        out_dir=tmp_path / "adapter",
        overrides=TINY,
        max_steps=40,
    )
    h = out.history
    assert out.status in ("max_steps", "converged") and len(h) >= 30
    eps = h[0]["epsilon"]
    early = sum(r["H_fgt"] for r in h[:3]) / 3
    late = sum(r["H_fgt"] for r in h[-5:]) / 5
    assert late > early + 0.25  # forget-token entropy (normalised by log V) rises
    assert h[-1]["lfgt_ema"] < 0.6 * h[0]["L_fgt"]
    assert max(r["L_ret"] for r in h) < 2 * eps + 0.05  # the retain constraint holds throughout ...
    assert sum(r["L_ret"] for r in h[-5:]) / 5 < eps + 0.1  # ... and ends within a small margin of epsilon

    saved = json.loads((out.adapter_dir / "history.json").read_text())
    assert [r["step"] for r in saved] == [r["step"] for r in h]

    base, tok = load_with_stack(engine_world.model, (), "cpu")
    after, _ = load_with_stack(engine_world.model, [out.adapter_dir], "cpu")
    forget_gain = _answer_loss(after, tok, engine_world.forget) - _answer_loss(base, tok, engine_world.forget)
    retain_gain = _answer_loss(after, tok, engine_world.retain) - _answer_loss(base, tok, engine_world.retain)
    assert forget_gain > 0.5 and retain_gain < 0.15 and forget_gain > 5 * retain_gain


def test_cli_unlearn_writes_adapter_history_and_summary(engine_world, tmp_path, capsys):
    out = tmp_path / "cli"
    code = main(
        [
            "unlearn",
            "--model",
            str(engine_world.model),
            "--forget",
            str(engine_world.forget),
            "--retain",
            str(engine_world.retain),
            "--out",
            str(out),
            "--max-steps",
            "3",
            "--preset",
            "tofu",
            "--set",
            "eta_out=1e-3",
            "--set",
            "batch_size=2",
            "--set",
            "max_length=64",
            "--no-progress",
        ]
    )
    assert code == 0
    assert {"adapter_config.json", "adapter_model.safetensors", "history.json"} <= {
        p.name for p in out.iterdir()
    }
    history = json.loads((out / "history.json").read_text())
    assert [r["step"] for r in history] == [1, 2, 3]
    for key in ("step", "L_fgt", "L_ret", "r", "lambda", "lr", "epsilon", "converged"):
        assert key in history[0]
    text = capsys.readouterr().out
    assert "status: max_steps after 3 steps" in text and "epsilon" in text


def test_cli_unlearn_off_a_terminal_logs_progress_lines_not_a_bar(engine_world, tmp_path, capsys):
    """pytest's captured stderr is no terminal, as a log file or a pipe is not."""
    from blade_core.unlearn import PROGRESS_LINE_EVERY

    steps = PROGRESS_LINE_EVERY + 1
    args = ["--max-steps", str(steps), "--set", "early_stop=false", "--set", "inner_steps=1"]
    small = ["--set", "batch_size=2", "--set", "grad_accum=1", "--set", "max_length=64"]
    paths = ["--model", str(engine_world.model), "--forget", str(engine_world.forget)]
    paths += ["--retain", str(engine_world.retain), "--out", str(tmp_path / "o")]
    assert main(["unlearn", *paths, *args, *small]) == 0
    err = capsys.readouterr().err
    assert "step/s" not in err  # the bar's rate: no bar was drawn
    lines = [line for line in err.splitlines() if line.startswith("unlearn: step")]
    assert len(lines) == 1 and lines[0].startswith(f"unlearn: step {PROGRESS_LINE_EVERY}/{steps} lambda ")


@pytest.mark.parametrize(
    ("extra", "pattern"),
    [
        (["--set", "taux=1"], "unknown parameter 'taux'"),
        (["--set", "tau=warm"], "BladeConfig.tau: cannot use 'warm'"),
        (["--set", "tau"], "expected KEY=VALUE"),
        (["--preset", "nope"], "unknown preset 'nope'"),
    ],
)
def test_cli_unlearn_bad_arguments_exit_non_zero_naming_the_cause(
    engine_world, tmp_path, capsys, extra, pattern
):
    code = main(
        [
            "unlearn",
            "--model",
            str(engine_world.model),
            "--forget",
            str(engine_world.forget),
            "--retain",
            str(engine_world.retain),
            "--out",
            str(tmp_path / "x"),
            *extra,
        ]
    )
    assert code != 0
    assert pattern in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_cli_unlearn_bad_dataset_names_file_and_line(engine_world, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "a"}\n{"question": "q2"}\n')
    code = main(
        [
            "unlearn",
            "--model",
            str(engine_world.model),
            "--forget",
            str(bad),
            "--retain",
            str(engine_world.retain),
            "--out",
            str(tmp_path / "x"),
            "--no-progress",
        ]
    )
    assert code != 0
    assert "bad.jsonl, line 2: field 'answer': missing" in capsys.readouterr().err


def test_use_lora_false_writes_a_full_model_and_says_so(engine_world, tmp_path):
    out = run_unlearning(
        model=engine_world.model,
        forget=engine_world.forget,
        retain=engine_world.retain,
        out_dir=tmp_path / "full",
        overrides={**TINY, "use_lora": "false"},
        max_steps=1,
    )
    assert out.full_model and "full model dir" in out.saved
    names = {p.name for p in out.adapter_dir.iterdir()}
    assert {"config.json", "model.safetensors", "history.json"} <= names
    assert "adapter_config.json" not in names
