"""Loading base models and tokenizers, and building the small Llama-architecture models we train ourselves.

Real loading code for hub ids and local directories (`trust_remote_code` off, safetensors only); nothing can
be downloaded here, so tests and the demo use models that `new_llama` builds and `train_tokenizer` tokenises.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from blade_service.contracts.errors import BaseModelUnavailable
from blade_service.contracts.hub_ids import could_be_hub_id

SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}


@dataclass(frozen=True)
class LlamaSize:
    """Width and depth of a from-scratch Llama; presets below."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    max_positions: int = 512
    tie_embeddings: bool = True


SIZES: dict[str, LlamaSize] = {
    # from scratch (one-stage `blade model build`, the demo model and the test fixtures)
    "test": LlamaSize(hidden=32, layers=2, heads=2, intermediate=64, max_positions=256),
    "quick": LlamaSize(hidden=96, layers=3, heads=4, intermediate=256, max_positions=256),
    "default": LlamaSize(hidden=192, layers=4, heads=6, intermediate=512, max_positions=512),
    # pretrained bases (two-stage build). base-default: Llama's proportions (head dim 64, MLP 8/3 x hidden,
    # untied embeddings), wide enough that LoRA r=8 on all seven projections is <= 2% of the parameters
    # (1.9% at a 5k vocabulary; Llama-2-7B: 0.3%), 4 layers so RMU can steer one with two below it.
    "base-test": LlamaSize(hidden=32, layers=2, heads=2, intermediate=64, max_positions=256),
    "base-quick": LlamaSize(hidden=96, layers=4, heads=4, intermediate=256, max_positions=256),
    "base-default": LlamaSize(
        hidden=448, layers=4, heads=7, intermediate=1216, max_positions=512, tie_embeddings=False
    ),
    # For an accelerator (`blade bench --model-size large --build-device cuda`): the same proportions at
    # 64 M parameters, 8 layers; LoRA r=8 is 1.45% of it. Its pretraining (~2e14 FLOP) took 28 s on an H200
    # and would take about an hour on one CPU core.
    "base-large": LlamaSize(
        hidden=768, layers=8, heads=12, intermediate=2048, max_positions=512, tie_embeddings=False
    ),
}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def pick_device(device: str | torch.device | None = None) -> torch.device:
    """The requested device, else CUDA when present, else the CPU."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each decoder layer's activations during the backward pass (non-reentrant, so frozen
    embeddings need no input gradients) and turn the KV cache off. transformers 5 renamed
    `gradient_checkpointing_enable` to `activation_checkpointing_enable`; the old name warns and goes in v6,
    and versions before the rename have only the old one. A PeftModel forwards either to its base model."""
    model.config.use_cache = False
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `texts`, with <s>, </s>, <pad>, <unk>."""
    tok = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS)


def new_llama(
    tokenizer: PreTrainedTokenizerFast, size: str | LlamaSize = "test", seed: int = 0
) -> LlamaForCausalLM:
    """A randomly initialised LlamaForCausalLM sized for `tokenizer` (fp32, deterministic in `seed`)."""
    spec = SIZES[size] if isinstance(size, str) else size
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        intermediate_size=spec.intermediate,
        max_position_embeddings=spec.max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=spec.tie_embeddings,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


# What a causal LM needs from a hub repository: config, safetensors weights and their index, tokenizer files.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "tokenizer*"]
# Second copies of the weights some repositories ship for other runtimes (e.g. Mistral's consolidated file).
HUB_SKIP = ["original/*", "consolidated*"]


def fetch_hub_model(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot directory of hub model `repo_id` at `revision` (default: main), downloaded into the
    hub cache (HF_HOME) or found there (HF_HUB_OFFLINE=1); BaseModelUnavailable with the hub's message."""
    from huggingface_hub import snapshot_download

    offline = _cache_only(repo_id)
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=HUB_PATTERNS,
            ignore_patterns=HUB_SKIP,
            local_files_only=offline is not None,
        )
    except (OSError, ValueError) as exc:  # hub errors (not found, gated, offline miss) are OSErrors
        if offline is not None:
            raise BaseModelUnavailable(_not_cached(repo_id, offline)) from exc
        at = f"@{revision}" if revision else ""
        raise BaseModelUnavailable(f"hub model {repo_id}{at}: {type(exc).__name__}: {exc}") from exc
    return Path(str(path))


HUB_CONNECT_TIMEOUT_S = 3.0  # one TCP connect to the hub before a load that would otherwise retry for ~1 min
HUB_RECHECK_S = 60.0  # a long-lived worker asks again after this long: an outage need not last its lifetime
_hub_checked: tuple[float, str | None] | None = None  # (monotonic time, answer) of the last check


def _hub_unreachable() -> str | None:
    """Why the hub (huggingface_hub's endpoint, HF_ENDPOINT) cannot be reached from this machine, or None:
    one TCP connect, its answer kept for `HUB_RECHECK_S`. Offline mode (HF_HUB_OFFLINE=1) asks nothing:
    the hub libraries then read only the cache already."""
    global _hub_checked
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return None
    if _hub_checked is not None and time.monotonic() - _hub_checked[0] < HUB_RECHECK_S:
        return _hub_checked[1]
    url = urlsplit(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    why = None
    try:
        socket.create_connection((url.hostname or "", port), timeout=HUB_CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        why = f"{constants.ENDPOINT}: {type(exc).__name__}: {exc}"
    _hub_checked = (time.monotonic(), why)
    return why


def _cache_only(ref: str | Path) -> str | None:
    """For a hub id, when the hub cannot be reached: why, so the load reads the hub cache only and fails at
    once instead of after the hub client's retries (about a minute per file). None for a local path or a
    reachable hub."""
    return None if Path(str(ref)).exists() else _hub_unreachable()


def _not_cached(ref: str | Path, why: str) -> str:
    return (
        f"{ref}: no such directory here, so it was read as a hub id; the hub cannot be reached from here "
        f"({why}), and the model is not in the hub cache (HF_HOME)"
    )


def _require_dir_or_hub_id(ref: str | Path) -> None:
    """BaseModelUnavailable for a reference that names no existing path and cannot be a hub id, so a
    mistyped directory reads as one instead of as the hub's complaint about repository names."""
    if not Path(str(ref)).exists() and not could_be_hub_id(str(ref)):
        raise BaseModelUnavailable(f"{ref}: no such directory (nor a hub id: name or namespace/name)")


def _where(ref: str | Path) -> str:
    """For a reference that is no path here: that it was read as a hub id (a registered base-model name is
    the service's, not a directory or a hub id)."""
    return "" if Path(str(ref)).exists() else "no such directory here, so it was read as a hub id, and "


def load_tokenizer(ref: str | Path, revision: str | None = None) -> PreTrainedTokenizerBase:
    """Tokenizer of a local model dir or hub id (at `revision`), with a pad token guaranteed (eos when the
    model has none)."""
    _require_dir_or_hub_id(ref)
    offline = _cache_only(ref)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(ref), revision=revision, trust_remote_code=False, local_files_only=offline is not None
        )
    except (OSError, ValueError) as exc:  # no such dir or hub id, no tokenizer files, unreadable files
        if offline is not None:
            raise BaseModelUnavailable(_not_cached(ref, offline)) from exc
        raise BaseModelUnavailable(f"{ref}: {_where(ref)}the tokenizer could not be loaded: {exc}") from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# transformers' from_pretrained changes process-wide state while it builds a model: torch's default dtype, and
# `PreTrainedModel.tie_weights`, a no-op until the load ends. Two threads loading at once (the embedded
# worker's thread pool: a /generate beside a request) left tied weights on the meta device and could leave
# tie_weights a no-op for the rest of the process (tests/test_model_loading.py), so loads take turns.
_LOAD_LOCK = threading.Lock()


def load_model(
    ref: str | Path,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    revision: str | None = None,
):
    """Causal LM from a local dir or hub id (at `revision`): safetensors only, no remote code; bf16 on CUDA,
    fp32 on CPU."""
    device = device or pick_device()
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    _require_dir_or_hub_id(ref)
    path = Path(str(ref))
    if path.exists() and not (path / "config.json").is_file():
        raise BaseModelUnavailable(f"{path}: not a model directory (no config.json)")
    offline = _cache_only(ref)
    try:
        with _LOAD_LOCK:
            model = AutoModelForCausalLM.from_pretrained(
                str(ref),
                revision=revision,
                dtype=dtype,
                trust_remote_code=False,
                use_safetensors=True,
                local_files_only=offline is not None,
                # transformers looks for an adapter config with these, not with the arguments above
                adapter_kwargs={"local_files_only": offline is not None},
            )
    except OSError as exc:  # no such dir or hub id, no safetensors weights, unreadable files
        if offline is not None:
            raise BaseModelUnavailable(_not_cached(ref, offline)) from exc
        raise BaseModelUnavailable(f"{ref}: {_where(ref)}the model could not be loaded: {exc}") from exc
    module: torch.nn.Module = model  # transformers wraps PreTrainedModel.to in a way mypy misreads
    return module.to(device)


def load_model_and_tokenizer(
    ref: str | Path,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    revision: str | None = None,
):
    """(model, tokenizer) for a local dir or hub id (at `revision`)."""
    return load_model(ref, device, dtype, revision), load_tokenizer(ref, revision)


def llama_param_count(spec: LlamaSize, vocab_size: int) -> int:
    """Parameters of `new_llama(spec)` with a `vocab_size` tokenizer: embeddings (x2 untied), per layer the
    attention (4 h^2) and MLP (3 h m) weights and two RMSNorms, and the final norm."""
    h, m = spec.hidden, spec.intermediate
    embeddings = vocab_size * h * (1 if spec.tie_embeddings else 2)
    return embeddings + spec.layers * (4 * h * h + 3 * h * m + 2 * h) + h


def lora_param_count(spec: LlamaSize, r: int = 8) -> int:
    """LoRA parameters of rank r on q/k/v/o/gate/up/down: r (d_in + d_out) per projection per layer."""
    h, m = spec.hidden, spec.intermediate
    per_layer = 4 * r * (h + h) + 2 * r * (h + m) + r * (m + h)
    return spec.layers * per_layer


def lora_fraction(model: torch.nn.Module, r: int = 8) -> dict[str, float | int]:
    """{'lora', 'params', 'fraction'}: LoRA r on the seven Llama projections (`LORA_TARGETS`) against all of
    `model`'s parameters, counted from its actual linear layers."""
    lora = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LORA_TARGETS:
            lora += r * (module.in_features + module.out_features)
    params = sum(p.numel() for p in model.parameters())
    return {"lora": lora, "params": params, "fraction": lora / params}
