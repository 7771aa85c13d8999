"""Where a model comes from: the MODEL a user names on the command line -> a directory the engine loads.

    (none)                  the embedded default model (default_model.py)
    an existing directory   a Hugging Face checkpoint or a packed expert store, used in place
    an existing .gguf file  imported once into tiermoe's cache (importers/), as the default model is
    org/model               a Hugging Face Hub repository, fetched by huggingface_hub's
                            snapshot_download into the Hub's own cache (HF_HOME, HF_HUB_CACHE) and
                            used from there; `revision` picks a branch, tag or commit;
                            HF_HUB_OFFLINE=1 uses only that cache; HF_TOKEN for gated/private repos

A local path wins over a repository id spelled the same, as in transformers and vLLM. `serve`,
`generate` and every other command that runs a model resolve MODEL here, once, so a name means
the same thing everywhere; every failure is one line (UserError) naming MODEL and what to do.
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections.abc import Callable
from pathlib import Path

from tiermoe.errors import UserError

GGUF_MAGIC = b"GGUF"
# What a checkpoint (or a packed store) needs from a repository: configs, tokenizer files, chat
# templates, safetensors weights and a store's expert file; never .bin/.pth/.gguf/ONNX copies.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken", "experts.bin"]
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")

Progress = Callable[[str], None]


def resolve_model(name: str | None, *, revision: str | None = None, progress: Progress | None = None) -> Path:
    """The local directory for MODEL `name` (module doc), fetching or importing it first if needed."""
    say = progress or _say
    if name is None:
        if revision:
            raise UserError("--revision needs MODEL to be a Hugging Face repo id (org/model)")
        from tiermoe.default_model import ensure_default_model

        return Path(ensure_default_model(progress=say))
    path = Path(name).expanduser()
    if path.exists():
        if revision:
            raise UserError(f"--revision applies to a Hugging Face repo id; {name} is a local path")
        if path.is_dir():
            check_store_halves(path)
            return path
        return import_gguf(path, progress=say)
    check_name(name)
    return hub_snapshot(name, revision=revision, progress=say)


def check_name(name: str) -> None:
    """Refuse, before any download, a MODEL that is neither an existing path nor a repo id."""
    if Path(name).expanduser().exists() or (is_repo_id(name) and not name.endswith(".gguf")):
        return
    hint = "" if name.startswith((".", "/", "~")) or name.endswith(".gguf") else \
        " (nor a Hugging Face repo id of the form org/model)"
    raise UserError(f"model path {name} does not exist{hint}")


def is_repo_id(name: str) -> bool:
    """`org/model` as the Hub spells repository ids (one slash, no `--` or `..`, at most 96 characters)."""
    return bool(_REPO_ID.fullmatch(name)) and "--" not in name and ".." not in name and len(name) <= 96


def check_store_halves(path: Path) -> None:
    """A packed store missing one of its two halves (or a pack that did not finish) would
    otherwise be read as a plain checkpoint and fail on the first expert tensor it cannot find,
    naming neither file."""
    from tiermoe.store.pack_checks import incomplete_store

    problem = incomplete_store(path)  # no manifest.json: an unfinished pack, or a store without it
    if problem:
        raise UserError(problem)
    if (path / "manifest.json").is_file() and not (path / "experts.bin").is_file():
        raise UserError(f"{path}: packed expert store without its experts.bin; re-run `tiermoe pack` into this "
                        "directory")


# ---- GGUF files ------------------------------------------------------------------------------------
def gguf_cache_dir(path: Path) -> Path:
    """Where the conversion of GGUF file `path` lives in tiermoe's cache. The key is the file's
    absolute path, size and modification time, so a replaced file is converted again, without
    reading gigabytes to hash them on every start."""
    from tiermoe.default_model import RECIPE_VERSION, cache_dir

    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:12]
    stem = re.sub(r"[^a-z0-9._-]+", "-", path.name.removesuffix(".gguf").lower()).strip("-.") or "model"
    return cache_dir() / "models" / f"gguf-{stem[:60]}-{key}-e8-bf16-v{RECIPE_VERSION}"


def import_gguf(path: Path, *, progress: Progress | None = None) -> Path:
    """The checkpoint directory converted from GGUF file `path` (converted on first use, then reused)."""
    try:
        with open(path, "rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise UserError(f"{path}: cannot read the model file ({exc.strerror or exc})") from None
    if magic != GGUF_MAGIC:
        raise UserError(f"{path}: not a GGUF file (MODEL must be a checkpoint directory, a packed store, "
                        "a .gguf file or a Hugging Face repo id)")
    from tiermoe.default_model import convert_once

    return convert_once(path, gguf_cache_dir(path), label=f"GGUF file {path.name}", ready=f"{path.name} imported",
                        progress=progress or _say)


# ---- Hugging Face Hub ------------------------------------------------------------------------------
def hub_snapshot(repo_id: str, *, revision: str | None = None, progress: Progress | None = None) -> Path:
    """A local snapshot of Hub repository `repo_id` (at `revision`), fetched into the Hub cache
    with the checkpoint's files only (HUB_PATTERNS); cached files are not fetched again."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub import errors as hf

    at = f" (revision {revision})" if revision else ""
    offline = bool(constants.HF_HUB_OFFLINE)
    cache = constants.HF_HUB_CACHE
    if not offline:
        (progress or _say)(f"fetching {repo_id}{at} from the Hugging Face Hub into {cache}")
    try:
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS))
    except hf.GatedRepoError:
        raise UserError(f"{repo_id}: a gated repository on the Hugging Face Hub; accept its terms on "
                        "huggingface.co and set HF_TOKEN") from None
    except hf.RepositoryNotFoundError:
        raise UserError(f"{repo_id}: no such model on the Hugging Face Hub (a private one needs HF_TOKEN)") from None
    except hf.RevisionNotFoundError:
        raise UserError(f"--revision {revision}: no such branch, tag or commit in {repo_id}") from None
    except hf.LocalEntryNotFoundError as exc:  # nothing (or too little) cached, and no download possible
        if offline:
            raise UserError(f"{repo_id}{at} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE=1 "
                            "forbids downloading it") from None
        cause = exc.__cause__ or exc
        raise UserError(f"cannot fetch {repo_id}{at} from the Hugging Face Hub ({_first_line(cause)}) and it is "
                        f"not in the cache ({cache})") from None
    except hf.HfHubHTTPError as exc:
        raise UserError(f"{repo_id}: the Hugging Face Hub refused the download ({_first_line(exc)})") from None
    except OSError as exc:  # disk full, permissions on the cache
        raise UserError(f"{repo_id}: cannot write the Hugging Face cache {cache} ({exc.strerror or exc})") from None
    if not (path / "config.json").is_file():
        raise UserError(f"{repo_id}{at}: the repository has no config.json, so it is no transformers checkpoint "
                        "(for a GGUF-only repository, download one .gguf file and serve its path)")
    return path


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def _say(msg: str) -> None:
    print(f"tiermoe: {msg}", file=sys.stderr, flush=True)
