"""What the model builders share (`build.py` from scratch, `pretrain.py` two-stage, `text_build.py` on text):
reading a TOFU-format data dir, the weighted next-token training step, the memorisation check, and the cached
model dir (`build_info.json`, a lock, an atomic save)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import platform
import random
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from blade_core.data import IGNORE_INDEX, encode_qa, format_qa
from blade_core.evaluation.generation import QA_STOP_STRINGS, generate
from blade_core.evaluation.metrics import prob_from_nll, rouge_l_recall
from blade_core.evaluation.scoring import mean_nlls, score_qa
from blade_service.contracts.records import DatasetError, read_records, validate_rows

TRAIN_FILES = (
    "retain90.json",
    "forget10_perturbed.json",
    "real_authors_perturbed.json",
    "world_facts_perturbed.json",
)
FORGET_SPLITS = ("forget01", "forget05", "forget10")
INFO_FILE = "build_info.json"


@dataclass
class BuildResult:
    model_dir: Path
    info: dict[str, Any]
    cached: bool


class BuildError(ValueError):
    """A data directory or setting `blade model build` cannot use; the message names the file or option."""


# --- reading the data dir -----------------------------------------------------------------------------------


@functools.cache  # the CPU does not change under a process: read /proc/cpuinfo once
def cpu_identity() -> str:
    """The CPU as its kernels see it: vendor, family and model (`/proc/cpuinfo`, Linux) and the instruction
    set torch dispatches to, e.g. 'AuthenticAMD family 25 model 1, AVX2'."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() in ("vendor_id", "cpu family", "model") and name.strip() not in fields:
                    fields[name.strip()] = value.strip()
                if not line.strip():
                    break  # the first processor's block is enough
    except OSError:
        pass
    chip = platform.processor() or platform.machine()
    if fields:
        vendor, family, model = (fields.get(k, "?") for k in ("vendor_id", "cpu family", "model"))
        chip = f"{vendor} family {family} model {model}"
    return f"{chip}, {torch.backends.cpu.get_cpu_capability()}"


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch's CPU thread count set to `threads` (None or 0: left as it is) for the block, then restored."""
    if not threads:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _flushing_denormals() -> bool:
    """Whether this thread's CPU currently treats subnormal floats as zero (torch has no getter for it)."""
    return torch.tensor(1e-310, dtype=torch.float64).mul(1.0).item() == 0.0


@contextlib.contextmanager
def flush_denormals() -> Iterator[None]:
    """Subnormal floats flushed to zero for the block (or a decorated function), then the caller's setting
    again. Training needs it: tiny gradients late in memorisation turn subnormal, 10x slower on CPU. Left on,
    it changes every later float computation in the process (float32's smallest normal number then rounds
    to 0, which numerical code such as Hypothesis's float strategies checks for and rejects)."""
    before = _flushing_denormals()
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(before)


# MKL reads these when it loads and then picks other kernels (on an AVX512 Intel box MKL_CBWR=AVX2 changes
# matmuls, exp and sqrt); unset, MKL picks by CPU, which `cpu_identity` already names.
MKL_KERNEL_SETTINGS = ("MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS")


def mkl_settings() -> dict[str, str]:
    """The MKL kernel settings this process runs under (`MKL_KERNEL_SETTINGS` that are set)."""
    return {name: os.environ[name] for name in MKL_KERNEL_SETTINGS if os.environ.get(name)}


def numerics(device: torch.device | None = None) -> dict[str, Any]:
    """What changes a build's weights besides its data, recipe and seed: the torch version, its CPU thread
    count (a float reduction split over two threads sums in another order than on one), the CPU (its
    kernels differ by model and instruction set), any MKL kernel setting in the environment and, for a
    build trained on an accelerator, that device's name. Part of every build key, so one key names one set
    of weights on every machine that builds it; `build_info.json` records the key. The MKL setting and the
    device enter only when set, so keys made without them keep their value."""
    mkl = mkl_settings()
    accelerator = {"device": device_name(device)} if device is not None and device.type != "cpu" else {}
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": cpu_identity(),
        **({"mkl": mkl} if mkl else {}),
        **accelerator,
    }


def device_name(device: torch.device) -> str:
    """`cpu`, or the accelerator's type and model, e.g. `cuda NVIDIA H200`."""
    if device.type == "cuda":
        return f"cuda {torch.cuda.get_device_name(device)}"
    return device.type


def read_qa(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        raise BuildError(f"{path}: missing: a TOFU-format dir needs {path.name} (see CONTRACT.md 'Files')")
    try:
        rows, _layout = read_records(path)
        validate_rows(path, rows, ("question", "answer"))
    except DatasetError as exc:
        raise BuildError(str(exc)) from None
    return [{"question": str(r.data["question"]), "answer": str(r.data["answer"])} for r in rows]


def split_file(data_dir: Path, split: str) -> Path:
    """The file of a forget split name (`forget05` -> forget05_perturbed.json)."""
    if split not in FORGET_SPLITS:
        raise BuildError(f"--exclude-split must be one of {', '.join(FORGET_SPLITS)}, got {split!r}")
    return data_dir / f"{split}_perturbed.json"


def training_rows(data_dir: str | Path, exclude_split: str | None = None):
    """(rows trained on, all rows the tokenizer sees, excluded rows): see the module docstring."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise BuildError(f"{data_dir}: not a directory (expected a TOFU-format data dir)")
    everything = [row for name in TRAIN_FILES for row in read_qa(data_dir / name)]
    excluded: list[dict[str, str]] = []
    rows = everything
    if exclude_split:
        excluded = read_qa(split_file(data_dir, exclude_split))
        drop = {(r["question"], r["answer"]) for r in excluded}
        rows = [r for r in everything if (r["question"], r["answer"]) not in drop]
        missing = len(drop) - len({(r["question"], r["answer"]) for r in everything} & drop)
        if missing:
            raise BuildError(
                f"{split_file(data_dir, exclude_split)}: {missing} of its rows are in none of "
                f"{', '.join(TRAIN_FILES)}, so excluding it would not match the target model"
            )
    return rows, everything, excluded


def data_hash(data_dir: Path, exclude_split: str | None = None) -> str:
    """sha256 over the names and contents of the data files a build reads."""
    h = hashlib.sha256()
    names = list(TRAIN_FILES) + ([split_file(data_dir, exclude_split).name] if exclude_split else [])
    for name in names:
        path = data_dir / name
        if not path.is_file():
            raise BuildError(f"{path}: missing: a TOFU-format dir needs {name} (see CONTRACT.md 'Files')")
        h.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


# --- measuring memorisation ---------------------------------------------------------------------------------


def answer_probs(model, tokenizer, rows: Sequence[dict[str, str]], batch_size: int = 64) -> list[float]:
    """Per-row answer Prob = exp(-mean answer-token NLL) under `format_qa` (the evaluation's scoring)."""
    scores = score_qa(model, tokenizer, [(r["question"], r["answer"]) for r in rows], batch_size=batch_size)
    return [float(p) for p in prob_from_nll(mean_nlls(scores))]


def memorisation(model, tokenizer, rows: Sequence[dict[str, str]], batch_size: int = 64) -> dict[str, float]:
    """{'prob', 'rouge', 'rows'}: mean answer Prob and ROUGE-L recall of greedy answers (as `blade eval`)."""
    if not rows:
        return {"prob": math.nan, "rouge": math.nan, "rows": 0}
    probs = answer_probs(model, tokenizer, rows, batch_size)
    longest = max(len(tokenizer(r["answer"], add_special_tokens=False)["input_ids"]) for r in rows)
    prompts = [format_qa(tokenizer, r["question"], r["answer"])[0] for r in rows]
    answers = generate(
        model, tokenizer, prompts, max_new_tokens=longest + 8, batch_size=batch_size, stop=QA_STOP_STRINGS
    )
    rouge = rouge_l_recall(answers, [r["answer"] for r in rows])
    return {"prob": round(sum(probs) / len(probs), 4), "rouge": round(rouge, 4), "rows": len(rows)}


# --- training -----------------------------------------------------------------------------------------------


def encode_for_training(tokenizer, rows: Sequence[dict[str, str]]) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) per row; the ids are `format_qa`'s prompt + answer + eos."""
    out = []
    for r in rows:
        ids, labels = encode_qa(tokenizer, r["question"], r["answer"])
        out.append((ids, sum(1 for x in labels if x == IGNORE_INDEX)))
    return out


def _batch(examples: Sequence[tuple[list[int], int]], pad_id: int, prompt_weight: float):
    """input_ids (B, T), attention_mask (B, T), targets (B, T-1), weights (B, T-1)."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    weights = torch.zeros((len(examples), width - 1))
    for i, (row, prompt_len) in enumerate(examples):
        ids[i, : len(row)] = torch.tensor(row)
        weights[i, : len(row) - 1] = prompt_weight
        weights[i, prompt_len - 1 : len(row) - 1] = 1.0  # position t predicts token t+1: answer targets
    mask = (torch.arange(width)[None, :] < torch.tensor([len(r) for r, _ in examples])[:, None]).long()
    return ids, mask, ids[:, 1:], weights


def weighted_step(
    model, opt, picked: Sequence[tuple[list[int], int]], pad_id: int, prompt_weight: float, lr: float
) -> float:
    """One optimiser step on `picked`; returns the loss as a float.

    loss = sum_t w_t * NLL_t / sum_t w_t with `_batch`'s weights; gradients clipped to norm 1.
    """
    device = next(model.parameters()).device
    ids, mask, targets, weights = (t.to(device) for t in _batch(picked, pad_id, prompt_weight))
    for group in opt.param_groups:
        group["lr"] = lr
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]  # (B, T-1, V)
    nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none")
    loss = (nll * weights.reshape(-1)).sum() / weights.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


def cosine_lr(peak: float, warmup: int, total: int, floor_ratio: float) -> Callable[[int], float]:
    """lr(step): linear warmup to `peak` over `warmup` steps, cosine to `peak * floor_ratio` at `total`."""

    def lr_at(step: int) -> float:
        if step < warmup:
            return peak * (step + 1) / warmup
        frac = min(1.0, (step - warmup) / max(1, total - warmup))
        floor = peak * floor_ratio
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * frac))

    return lr_at


def qa_key(row: dict[str, str]) -> tuple[str, str]:
    return row["question"], row["answer"]


def monitor_sample(rows: Sequence[dict[str, str]], n: int, seed: int) -> list[dict[str, str]]:
    if len(rows) <= n:
        return list(rows)
    return random.Random(f"blade-monitor:{seed}").sample(list(rows), n)


# --- the model dir ------------------------------------------------------------------------------------------


class Eos:
    """Stands in for a tokenizer before one exists: `format_qa` only needs its eos token here."""

    eos_token = "</s>"
    chat_template = None


def save_model(model, tokenizer, info: dict[str, Any], out_dir: Path) -> None:
    """Write atomically-ish: into a sibling temp dir, then swap, so a crash never leaves a half model."""
    tmp = out_dir.with_name(out_dir.name + ".tmp-build")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.to("cpu").save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / INFO_FILE).write_text(json.dumps(info, indent=1) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)


def check_replaceable(out_dir: Path) -> None:
    """A build replaces `out_dir` whole: refuse unless it is missing, empty or an earlier build's output."""
    if out_dir.exists() and not out_dir.is_dir():
        raise BuildError(f"--out {out_dir}: exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / INFO_FILE).is_file():
        raise BuildError(
            f"--out {out_dir}: a non-empty directory that holds no earlier build ({INFO_FILE}); "
            "pick a new or empty directory, since a build replaces the whole directory"
        )


@contextlib.contextmanager
def file_lock(lock_file: Path):
    """An exclusive advisory lock, so concurrent builds of one output wait for each other (POSIX only)."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl  # lazy: POSIX only (the fallback below)
    except ImportError:  # not POSIX: no lock
        yield
        return
    with open(lock_file, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def dir_lock(path: Path):
    """`file_lock` for making `path` (a directory): held through its sibling `<name>.lock`, so every process
    that makes or reuses `path` waits for the one making it."""
    return file_lock(path.with_name(path.name + ".lock"))


def read_info(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / INFO_FILE).read_text())


def info_key(model_dir: Path) -> str | None:
    try:
        info = read_info(model_dir)
    except (OSError, ValueError):
        return None
    return info.get("key") if (model_dir / "model.safetensors").is_file() else None
