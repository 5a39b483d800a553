"""The two-stage target (`blade_core.pretrain`): cached base, TOFU's fine-tune, LoRA fraction, no leaks."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
import torch

from blade_core.build import build_model
from blade_core.build_common import cpu_identity, numerics
from blade_core.modeling import (
    LORA_TARGETS,
    SIZES,
    llama_param_count,
    lora_fraction,
    lora_param_count,
    new_llama,
    train_tokenizer,
)
from blade_core.pretrain import (
    TWO_STAGE,
    BaseRecipe,
    FinetuneRecipe,
    TwoStage,
    _linear,
    base_key,
    corpus_texts,
)
from blade_core.synth import pretrain_corpus, world_summary, write_world
from blade_service.cli.main import main
from tests.fixtures_engine import step_lines_without_clock

# One epoch of each stage on a 6-person corpus: exercises every path of a two-stage build in seconds.
TINY = TwoStage(
    BaseRecipe("base-test", people=6, vocab_size=512, epochs=1, warmup_steps=5, general_repeats=1),
    FinetuneRecipe(epochs=1, lr=3e-3),
)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("world")
    write_world(out, authors=4, seed=5)
    return out


@pytest.fixture(scope="module")
def built(world: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("two-stage")
    cache = root / "cache"
    logged: list[str] = []
    with pytest.MonkeyPatch.context() as patch:
        step_lines_without_clock(patch)  # no progress bar: a line per step, 'label: i/N'
        target = build_model(
            world, root / "target", two_stage=TINY, cache_dir=cache, progress=False, log=logged.append
        )
    gold = build_model(
        world, root / "gold", two_stage=TINY, exclude_split="forget10", cache_dir=cache, progress=False
    )
    return {"root": root, "cache": cache, "target": target, "gold": gold, "logged": logged}


# --- the LoRA fraction -------------------------------------------------------------------------------------


def test_param_counts_match_the_model_and_peft() -> None:
    from peft import LoraConfig, get_peft_model

    tokenizer = train_tokenizer(["Question: Who?\nAnswer: Ann.</s>"] * 4, vocab_size=300)
    for size in ("base-test", "base-quick"):
        model = new_llama(tokenizer, size)
        params = sum(p.numel() for p in model.parameters())
        assert params == llama_param_count(SIZES[size], len(tokenizer)), size
        counted = lora_fraction(model, 8)
        assert counted["lora"] == lora_param_count(SIZES[size], 8) and counted["params"] == params
        peft = get_peft_model(model, LoraConfig(r=8, target_modules=list(LORA_TARGETS)))
        trainable = sum(p.numel() for p in peft.parameters() if p.requires_grad)
        assert trainable == counted["lora"], size


def test_default_target_keeps_lora_r8_at_most_2_percent() -> None:
    """At the vocabulary the default base's corpus really yields (the BPE saturates below its request);
    the large size pretrains on the same corpus."""
    for size in ("default", "large"):
        recipe = TWO_STAGE[size].base
        tokenizer = train_tokenizer(corpus_texts(recipe, "</s>"), vocab_size=recipe.vocab_size)
        spec = SIZES[recipe.size]
        fraction = lora_param_count(spec, 8) / llama_param_count(spec, len(tokenizer))
        assert fraction <= 0.02, (size, len(tokenizer), fraction)
    # the from-scratch sizes are far above it (the reason for the new target)
    assert lora_param_count(SIZES["quick"]) / llama_param_count(SIZES["quick"], 1024) > 0.05


# --- the corpus --------------------------------------------------------------------------------------------


def test_corpus_never_names_a_world_author_or_title() -> None:
    corpus = pretrain_corpus(people=300, seed=0)
    text = "\n".join(
        [r["question"] + " " + r["answer"] for r in corpus["qa"] + corpus["general_qa"]]
        + corpus["text"]
        + corpus["general_text"]
    )
    for seed in range(4):
        summary = world_summary(authors=40, seed=seed)
        names = summary["retain_authors"] + summary["forget_authors"]["forget10"]
        names += summary["holdout_authors"]["holdout10"]
        assert len(names) == 44
        assert not [n for n in names if n in text], seed
    # ... while the world's general knowledge (its probe sets) is in it, phrased several ways
    rows = pretrain_corpus(people=0)
    assert len(rows["general_text"]) > 3 * len(rows["general_qa"]) // 2
    assert pretrain_corpus(people=5, seed=1) == pretrain_corpus(people=5, seed=1)


# --- the two-stage build -----------------------------------------------------------------------------------


def test_a_build_without_progress_bars_logs_its_steps(built: dict) -> None:
    # which steps get a line and what they count (the fixture leaves the clock's durations out of the line)
    steps = built["logged"]
    pretraining = [line for line in steps if line.startswith("pretraining: ")]
    total = int(pretraining[0].rsplit("/", 1)[1])
    assert pretraining == [f"pretraining: {i}/{total}" for i in range(1, total + 1)], steps
    n = built["target"].info["steps"]  # the fine-tune's
    assert [line for line in steps if line.startswith("fine-tuning: ")] == [
        f"fine-tuning: {i}/{n}" for i in range(1, n + 1)
    ], steps


def test_base_is_built_once_and_shared(built: dict) -> None:
    bases = [p for p in built["cache"].glob("base-test-*") if p.is_dir()]
    assert len(bases) == 1
    base_info = json.loads((bases[0] / "build_info.json").read_text())
    assert base_info["stage"] == "base" and base_info["corpus_tokens"] > 0
    for name in ("target", "gold"):
        info = built[name].info
        assert info["stage"] == "finetune" and info["base"]["key"] == base_info["key"]
        assert info["recipe"]["epochs"] == 1 and info["recipe"]["lr"] == TINY.finetune.lr
        assert len(info["epoch_loss"]) == 1 and info["lora"]["fraction"] > 0
        # the base's tokenizer, unchanged: target and gold tokenise alike
        tok = json.loads((built["root"] / name / "tokenizer.json").read_text())["model"]
        assert tok == json.loads((bases[0] / "tokenizer.json").read_text())["model"]


def test_fine_tune_changes_the_base_and_gold_excludes_the_split(built: dict, world: Path) -> None:
    from safetensors.torch import load_file

    base_dir = Path(built["target"].info["base"]["dir"])
    base = load_file(base_dir / "model.safetensors")
    target = load_file(built["root"] / "target" / "model.safetensors")
    gold = load_file(built["root"] / "gold" / "model.safetensors")
    assert base.keys() == target.keys()
    assert any(not (base[k] == target[k]).all() for k in base)
    assert any(not (gold[k] == target[k]).all() for k in base)
    forget = json.loads((world / "forget10_perturbed.json").read_text())
    assert built["gold"].info["excluded_rows"] == len(forget)
    assert built["gold"].info["train_rows"] == built["target"].info["train_rows"] - len(forget)


def test_rebuild_is_a_cache_hit_and_a_new_lr_is_not(built: dict, world: Path) -> None:
    again = build_model(
        world, built["root"] / "target", two_stage=TINY, cache_dir=built["cache"], progress=False
    )
    assert again.cached and again.info["key"] == built["target"].info["key"]
    other = dataclasses.replace(TINY, finetune=dataclasses.replace(TINY.finetune, lr=1e-3))
    moved = build_model(
        world, built["root"] / "t2", two_stage=other, cache_dir=built["cache"], progress=False
    )
    assert not moved.cached and moved.info["base"]["key"] == built["target"].info["base"]["key"]


def test_a_build_key_names_the_torch_thread_count(world: Path, tmp_path: Path) -> None:
    """A float sum split over two threads rounds differently than on one, so the same recipe gives other
    weights: a build made on another thread count is never taken for this one (the base's key and the
    fine-tune's both differ), and each is found again under its own."""
    one = build_model(
        world, tmp_path / "t", two_stage=TINY, cache_dir=tmp_path / "c", threads=1, progress=False
    )
    two = build_model(
        world, tmp_path / "t", two_stage=TINY, cache_dir=tmp_path / "c", threads=2, progress=False
    )
    assert not two.cached and two.info["key"] != one.info["key"]
    assert two.info["base"]["key"] != one.info["base"]["key"]
    again = build_model(
        world, tmp_path / "t", two_stage=TINY, cache_dir=tmp_path / "c", threads=1, progress=False
    )
    assert again.cached and again.info["key"] == one.info["key"]


def test_a_build_key_names_the_mkl_kernel_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """MKL_CBWR makes MKL pick other kernels (other floats), so a base built under it has its own key; unset,
    the key is what it was before the setting existed, so earlier caches stay valid."""
    monkeypatch.delenv("MKL_CBWR", raising=False)
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    plain = base_key(TINY.base)
    assert numerics() == {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": cpu_identity(),
    }
    monkeypatch.setenv("MKL_CBWR", "AVX2")
    assert numerics()["mkl"] == {"MKL_CBWR": "AVX2"}
    assert base_key(TINY.base) != plain
    monkeypatch.setenv("MKL_CBWR", "")
    assert base_key(TINY.base) == plain


def test_a_build_key_names_an_accelerator_and_the_cpu_keys_stay(built: dict, world: Path) -> None:
    """Weights trained on an accelerator differ from the CPU's, so its name enters both stages' keys; a
    build on the CPU named explicitly is the default build, found again in the cache."""
    meta = torch.device("meta")
    assert numerics(torch.device("cpu")) == numerics() and numerics(meta)["device"] == "meta"
    plain = base_key(TINY.base, 0)
    assert base_key(TINY.base, 0, meta) != plain == base_key(TINY.base, 0, torch.device("cpu"))
    again = build_model(
        world,
        built["root"] / "target",
        two_stage=TINY,
        cache_dir=built["cache"],
        device=torch.device("cpu"),
        progress=False,
    )
    assert again.cached and again.info["key"] == built["target"].info["key"]
    assert again.info["device"] == "cpu"


def test_a_build_from_scratch_refuses_an_accelerator(world: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="two-stage builds"):
        build_model(world, tmp_path / "m", size="test", device=torch.device("cuda"), progress=False)
    assert not (tmp_path / "m").exists()


def test_an_explicit_base_dir_is_fine_tuned(built: dict, world: Path, tmp_path: Path) -> None:
    base_dir = Path(built["target"].info["base"]["dir"])
    result = build_model(world, tmp_path / "m", base=base_dir, two_stage=TINY, progress=False)
    assert result.info["base"]["dir"] == str(base_dir.resolve())
    with pytest.raises(ValueError, match=r"no config\.json"):
        build_model(world, tmp_path / "n", base=tmp_path, two_stage=TINY, progress=False)


def test_a_fine_tune_without_progress_draws_no_loading_bar(
    built: dict, world: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """transformers draws a "Loading weights" bar per model load; a bench with --no-progress writes its log
    to a file, where each bar was a line of carriage returns."""
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()
    base_dir = Path(built["target"].info["base"]["dir"])
    build_model(world, tmp_path / "m", base=base_dir, two_stage=TINY, progress=False)
    assert "Loading weights" not in capsys.readouterr().err


def test_a_build_leaves_subnormal_floats_as_it_found_them(built: dict) -> None:
    """Training flushes subnormals to zero for speed (`build_common.flush_denormals`); the build must not
    leave that on for the rest of the process (it once did, and Hypothesis's float strategies then failed
    in the API fuzz tests that happened to run after a build in the same worker)."""
    import torch

    from blade_core.build_common import _flushing_denormals, flush_denormals

    half_tiny = torch.tensor(torch.finfo(torch.float32).tiny, dtype=torch.float32) / 2
    assert half_tiny.item() > 0.0 and not _flushing_denormals()
    with flush_denormals():
        assert _flushing_denormals()
    assert not _flushing_denormals()


def test_tofu_schedule_warms_up_one_epoch_then_decays_to_zero() -> None:
    recipe = TWO_STAGE["default"].finetune
    assert (recipe.epochs, recipe.batch_size, recipe.weight_decay, recipe.prompt_loss_weight) == (
        5,
        8,
        0.01,
        0,
    )
    steps_per_epoch = 10
    lr_at = _linear(1.0, steps_per_epoch, 5 * steps_per_epoch)
    lrs = [lr_at(s) for s in range(5 * steps_per_epoch)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:])) and lrs[-1] < 0.05


def test_cli_builds_two_stage_and_prints_the_lora_fraction(
    world: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(TWO_STAGE, "test", TINY)
    args = ["model", "build", "--data", str(world), "--out", str(tmp_path / "m"), "--size", "test"]
    assert main([*args, "--pretrain", "--cache-dir", str(tmp_path / "c"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "LoRA r=8 on q/k/v/o/gate/up/down" in out and "% of the model's" in out
    with pytest.raises(SystemExit):  # one or the other
        main([*args, "--pretrain", "--base", str(tmp_path)])


def test_cli_compare_prints_ours_beside_tofu(
    built: dict, world: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = built["root"]
    args = ["model", "compare", "--data", str(world), "--target", str(root / "target")]
    args += ["--gold", str(root / "gold"), "--max-rows", "4", "--max-new-tokens", "4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| forget10 | ours | target (finetuned) |" in out and "| forget10 | ours | gold (retain) |" in out
    assert "Llama-2-7b-chat" in out
    assert main(["model", "compare", "--data", str(world), "--target", str(root / "nowhere")]) == 2


def test_bench_builds_two_stage_targets_by_default(
    world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from blade_core import bench

    monkeypatch.setitem(TWO_STAGE, "test", TINY)
    assert bench.PRESETS["default"].pretrained and bench.PRESETS["quick"].pretrained
    assert bench.PRESETS["default"].model_size == "default"
    settings = dataclasses.replace(bench.PRESETS["quick"], model_size="test")
    _, target, golds = bench.prepare_models(world, tmp_path, settings, ["forget10"], log=lambda _m: None)
    assert target is not None
    info = json.loads((target / "build_info.json").read_text())
    gold_info = json.loads((golds["forget10"] / "build_info.json").read_text())
    assert info["stage"] == gold_info["stage"] == "finetune"
    assert info["base"]["key"] == gold_info["base"]["key"]
