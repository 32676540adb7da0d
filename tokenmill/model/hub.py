"""Hugging Face Hub model ids: fetch what the engine reads into the Hub cache, return a local path.

`download_model("ORG/NAME")` is the snapshot folder holding the config, generation config,
tokenizer files and the safetensors weights (the shards `model.safetensors.index.json` names, or
every top-level `*.safetensors`); never `.bin`/`.pth`/`.pt` twins or subfolders. A GGUF in a repo
is `ORG/NAME:QUANT` (the one `.gguf` named for that quantization, e.g. `:Q4_K_M`) or
`gguf_file=FILE`; only that file is fetched. `HF_TOKEN`, `HF_ENDPOINT` and `HF_HUB_OFFLINE` (then
the cache alone) are read when the name is resolved; huggingface_hub draws the progress bars.

A first metadata request with a short timeout tells a missing id, a gated repo or no network
apart in seconds; every failure is one `HubModelError` line naming the id and what to do. With
no network the cache is used if it holds the snapshot. The front-end resolves a name once:
workers only ever see the local path.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import re

logger = logging.getLogger(__name__)

# Small files the engine may read next to the weights: config, generation config, every
# tokenizer format transformers loads, chat templates, quantization configs, the shard index.
CONFIG_PATTERNS = ("config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "*.tiktoken",
                   "chat_template.json", "chat_template.jinja", "quantize_config.json", "quant_config.json",
                   "model.safetensors.index.json")
SAFETENSORS_INDEX = "model.safetensors.index.json"
_TOP_LEVEL_ONLY = ["*/*"]
_QUANT = re.compile(r"[A-Za-z0-9_.-]+")  # ignore_patterns: nothing from subfolders (onnx/, original/, ...)


class HubModelError(ValueError):
    """A Hub model id that cannot be resolved (missing, gated, no network and not cached, no
    usable files). The message is one line naming the id and what to do."""


def is_hub_id(name: str) -> bool:
    """True for `NAME`, `ORG/NAME` and `ORG/NAME:QUANT` as the Hub spells repo ids (a name ending
    in .gguf is a local file)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo_id, quant = split_quant(name)
    if name.endswith(".gguf") or (quant is not None and not _QUANT.fullmatch(quant)):
        return False
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return False
    return True


def split_quant(name: str) -> tuple[str, str | None]:
    """`ORG/NAME:Q4_K_M` -> ("ORG/NAME", "Q4_K_M"); no colon -> (name, None)."""
    repo_id, sep, quant = name.partition(":")
    return (repo_id, quant) if sep and quant else (name, None)


def download_model(name: str, *, revision: str | None = None, download_dir: str | None = None,
                   gguf_file: str | None = None, weights: bool = True) -> str:
    """The local path of Hub model `name`: a snapshot folder, or a .gguf file in one.

    `weights=False` fetches the config and tokenizer only (dummy weights, a tokenizer repo).
    `download_dir` is the Hub cache to use (default: HF_HUB_CACHE / HF_HOME's).
    """
    repo_id, quant = split_quant(name)
    if quant and gguf_file:
        raise HubModelError(f"model {name!r}: give the GGUF file either as ':{quant}' or with "
                            f"--gguf-file {gguf_file}, not both")
    hub = _Hub(repo_id, revision, download_dir)
    if quant or gguf_file:
        return hub.fetch_gguf(quant, gguf_file)
    folder = hub.fetch(list(CONFIG_PATTERNS))
    if not os.path.isfile(os.path.join(folder, "config.json")):
        ggufs = [f for f in hub.files or () if f.endswith(".gguf")]
        hint = (f"; it holds GGUF files ({_listing(ggufs)}): name one as {repo_id}:QUANT or with --gguf-file FILE"
                if ggufs else "")
        raise HubModelError(f"model {repo_id!r} has no config.json {hub.where}{hint}")
    if weights:
        folder = hub.fetch(_weight_patterns(folder))
        if not any(n.endswith(".safetensors") for n in os.listdir(folder)):
            others = [f for f in hub.files or () if f.endswith((".bin", ".pth", ".pt"))]
            hint = f" (it has {_listing(others)}: tokenmill loads safetensors only)" if others else ""
            raise HubModelError(f"model {repo_id!r} has no .safetensors weights {hub.where}{hint}")
    return folder


def _weight_patterns(folder: str) -> list[str]:
    """The shards the index names (a repo may also hold consolidated twins), else every top-level
    .safetensors: the same files the safetensors loader reads."""
    index = os.path.join(folder, SAFETENSORS_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    return ["*.safetensors"]


def quant_matches(files: list[str], quant: str) -> list[str]:
    """The .gguf files named for quantization `quant` (any case): `x-Q4_K_M.gguf`, `x.q4_k_m.gguf`,
    `Q4_K_M.gguf`, but not `x-Q4_K_M_L.gguf`."""
    patterns = _quant_patterns(quant)
    return sorted(f for f in files if any(fnmatch.fnmatchcase(f, p) for p in patterns))


def _quant_patterns(quant: str) -> list[str]:
    cases = dict.fromkeys((quant, quant.upper(), quant.lower()))
    return [p for q in cases for p in (f"{q}.gguf", f"*[-._/]{q}.gguf")]


def _listing(files: list[str], limit: int = 6) -> str:
    shown = ", ".join(files[:limit])
    return shown + (f", ... ({len(files) - limit} more)" if len(files) > limit else "")


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


class _Hub:
    """One repo at one revision: a metadata probe, then snapshot_download calls for file patterns."""

    def __init__(self, repo_id: str, revision: str | None, download_dir: str | None) -> None:
        from huggingface_hub import constants

        self.repo_id, self.revision, self.download_dir = repo_id, revision, download_dir
        self.endpoint = os.environ.get("HF_ENDPOINT", "").rstrip("/") or constants.ENDPOINT
        self.cache = download_dir or constants.HF_HUB_CACHE
        self.timeout = float(constants.HF_HUB_ETAG_TIMEOUT)
        self.offline = constants.HF_HUB_OFFLINE or _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")
        self.unreachable: str | None = None  # why the Hub could not be reached (then: the cache alone)
        self.files: list[str] | None = None  # the repo's files, when the Hub answered
        self._warned = False
        if not self.offline:
            self._probe()

    @property
    def where(self) -> str:
        return "on the Hugging Face Hub" if self.files is not None else f"in the Hugging Face cache {self.cache}"

    @property
    def local_only(self) -> bool:
        return self.offline or self.unreachable is not None

    def _probe(self) -> None:
        """Repo metadata with a short timeout: a missing id, a gated repo or no network, at once."""
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError

        try:
            info = HfApi(endpoint=self.endpoint).model_info(self.repo_id, revision=self.revision,
                                                            timeout=self.timeout)
        except HfHubHTTPError as exc:
            raise HubModelError(self._http_error(exc)) from None
        except Exception as exc:  # the transport's connect/timeout errors: no Hub, try the cache
            self.unreachable = f"{type(exc).__name__}: {_first_line(exc)}"
            return
        self.files = sorted(s.rfilename for s in info.siblings or ())

    def fetch(self, patterns: list[str]) -> str:
        """The snapshot folder with the repo's files matching `patterns` (top level) downloaded."""
        return self._snapshot(patterns, _TOP_LEVEL_ONLY)

    def fetch_gguf(self, quant: str | None, gguf_file: str | None) -> str:
        name = f"{self.repo_id}:{quant}" if quant else self.repo_id
        if gguf_file is None:
            assert quant is not None
            if self.files is not None:  # online: pick from the listing, fetch that file alone
                found = quant_matches(self.files, quant)
            else:  # offline: what the cache holds for this quantization
                folder = self._snapshot(_quant_patterns(quant), None)
                found = quant_matches(_tree(folder), quant)
            if len(found) != 1:
                ggufs = [f for f in self.files or () if f.endswith(".gguf")]
                where = f"its .gguf files: {_listing(ggufs) or 'none'}" if self.files is not None else \
                    "looked in the Hugging Face cache only"
                what = ("no .gguf file" if not found else
                        f"{len(found)} .gguf files ({_listing(found)}); name one with --gguf-file")
                raise HubModelError(f"model {name!r}: {what} for quantization {quant!r} ({where})")
            gguf_file = found[0]
        elif self.files is not None and gguf_file not in self.files:
            ggufs = [f for f in self.files if f.endswith(".gguf")]
            raise HubModelError(f"model {self.repo_id!r} has no file {gguf_file!r} on the Hugging Face Hub "
                                f"(its .gguf files: {_listing(ggufs) or 'none'})")
        path = os.path.join(self._snapshot([gguf_file], None), gguf_file)
        if not os.path.isfile(path):
            raise HubModelError(f"model {name!r}: {gguf_file!r} is not in the Hugging Face cache ({self.cache})")
        return path

    def _snapshot(self, allow: list[str], ignore: list[str] | None) -> str:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

        if not self.local_only:
            logger.info("model %r: fetching %s from %s into %s", self.repo_id, ", ".join(allow),
                        self.endpoint, self.cache)
        try:
            # The revision as given (a branch stays a ref in the cache, for offline use later).
            folder = snapshot_download(self.repo_id, revision=self.revision, cache_dir=self.download_dir,
                                       allow_patterns=allow, ignore_patterns=ignore, endpoint=self.endpoint,
                                       local_files_only=self.local_only, etag_timeout=self.timeout)
        except HfHubHTTPError as exc:
            raise HubModelError(self._http_error(exc)) from None
        except (LocalEntryNotFoundError, OSError) as exc:
            raise HubModelError(self._not_cached(exc)) from None
        except Exception as exc:  # the transport's errors once its retries are spent
            raise HubModelError(f"model {self.repo_id!r}: the download from {self.endpoint} failed ("
                                f"{type(exc).__name__}: {_first_line(exc)}): try again, or pass a local path") from None
        if self.unreachable is not None and not self._warned:
            self._warned = True
            logger.warning("model %r: the Hugging Face Hub at %s cannot be reached (%s): using the cached copy in %s",
                           self.repo_id, self.endpoint, self.unreachable, self.cache)
        return folder

    def _http_error(self, exc) -> str:
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

        repo, status = self.repo_id, getattr(getattr(exc, "response", None), "status_code", None)
        if isinstance(exc, GatedRepoError):
            return (f"model {repo!r} is gated on the Hugging Face Hub (HTTP {status}): accept its terms at "
                    f"{self.endpoint}/{repo} and set HF_TOKEN to an access token of that account")
        if isinstance(exc, RevisionNotFoundError):
            return f"model {repo!r} has no revision {self.revision!r} on the Hugging Face Hub: check --revision"
        if isinstance(exc, RepositoryNotFoundError):
            return (f"model {repo!r} is neither a local folder or .gguf file nor a model on the Hugging Face Hub "
                    f"({self.endpoint}): check the name, or set HF_TOKEN if the repository is private")
        if status in (401, 403):
            return (f"model {repo!r}: the Hugging Face Hub refused access (HTTP {status}): set HF_TOKEN to an "
                    f"access token that can read it")
        return (f"model {repo!r}: the Hugging Face Hub answered HTTP {status} ({_first_line(exc)}): try again "
                f"later, or pass a local folder or .gguf file")

    def _not_cached(self, exc: BaseException) -> str:
        rev = f" (revision {self.revision!r})" if self.revision else ""
        if self.offline:
            return (f"model {self.repo_id!r}{rev} is not in the Hugging Face cache {self.cache} with the files the "
                    f"engine needs, and HF_HUB_OFFLINE is set: download it once without HF_HUB_OFFLINE, or pass "
                    f"a local path")
        if self.unreachable is not None:
            return (f"cannot reach the Hugging Face Hub at {self.endpoint} for model {self.repo_id!r}{rev} "
                    f"({self.unreachable}) and the cache {self.cache} does not hold it: check the network or "
                    f"HF_ENDPOINT, or pass a local folder or .gguf file")
        return f"model {self.repo_id!r}{rev}: the download failed ({_first_line(exc)}): try again, or pass a local path"


def _tree(folder: str) -> list[str]:
    """Every file under `folder`, as repo paths."""
    if not os.path.isdir(folder):
        return []
    return sorted(os.path.relpath(os.path.join(root, f), folder).replace(os.sep, "/")
                  for root, _, files in os.walk(folder) for f in files)


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
