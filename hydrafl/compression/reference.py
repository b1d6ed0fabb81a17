"""The site's side of compressed downloads (`hydrafl.compression.downloads`): the reference model it holds,
rebuilt from each message exactly as the coordinator rebuilt it, or the message refused.

A change is applied only to the reference it names (by digest), and what it rebuilds must hash to the digest the
coordinator computed: the site never trains on another model than the one the coordinator believes it holds.
The site keeps its last `SITE_REFERENCES` references, one per coordinates it was sent (a subnetwork's slices, the
whole model), in the run's `context.state` and, for a site with a state directory (`hydrafl site
--state-dir`), in a file there too, so a restarted site keeps them.
"""

from __future__ import annotations

import json
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context, Message

from hydrafl.arrays import array_view, from_record, to_record
from hydrafl.compression.codecs import decode
from hydrafl.compression.downloads import DELTA, FULL, SITE_REFERENCES, Tensors, content_hash
from hydrafl.compression.feedback import coordinates_key, read_state, state_path, write_state
from hydrafl.compression.layout import DOWNLOAD_RECORD, Scheme, download_shapes
from hydrafl.run_settings import run_settings
from hydrafl.site_config import SiteConfig

STATE_ARRAYS = "download.references"
"""The `context.state` ArrayRecord of the reference models, each tensor named `POSITION/NAME`."""
STATE_CONFIG = "download.reference-index"
"""The `context.state` ConfigRecord of the references' coordinates `keys` and `digests`, by position."""


class DownloadError(ValueError):
    """A download the site cannot rebuild exactly; says why (the coordinator sends the whole model next)."""


def receive_download(message: Message, context: Context) -> None:
    """`message` with its download turned into the model it stands for, in place (the record removed, the arrays
    whole), and that model kept as the site's reference for the message's coordinates; DownloadError (or
    CompressionError, for a change not in the run's scheme) when it cannot be rebuilt exactly, references unchanged."""
    download = message.content[DOWNLOAD_RECORD]
    del message.content[DOWNLOAD_RECORD]
    names = [name for name, record in message.content.items() if isinstance(record, ArrayRecord)]
    if not isinstance(download, ConfigRecord) or len(names) != 1:
        raise DownloadError(f"a download is a ConfigRecord with one ArrayRecord, not {len(names)}")
    arrays, state_dir = (
        message.content[names[0]],
        SiteConfig.from_node_config(context.node_config).state_dir,
    )
    config = run_settings(message, context)
    scheme = Scheme.from_config(config)
    key, held = coordinates_key(config, scheme), site_references(context, state_dir)
    if download.get("mode") == FULL:
        if any(array.dtype != "float32" for array in arrays.values()):
            raise DownloadError("a whole model sent as a reference must be float32")
        model = from_record(arrays)
    elif download.get("mode") == DELTA:
        model = _rebuilt(download, arrays, scheme, *held.get(key, ("", None)))
    else:
        raise DownloadError(
            f"download mode {download.get('mode')!r} is neither {FULL!r} nor {DELTA!r}"
        )
    digest = content_hash(model)
    if digest != download.get("target"):
        raise DownloadError(
            f"the model rebuilt from the download hashes to {digest[:12]}, the coordinator's to "
            f"{str(download.get('target'))[:12]}; refused rather than trained on"
        )
    held.pop(key, None)
    held[key] = (digest, model)
    _keep(context, state_dir, dict(list(held.items())[-SITE_REFERENCES:]))
    if download["mode"] == DELTA:
        message.content[names[0]] = to_record(model)


def _rebuilt(
    download: ConfigRecord,
    arrays: ArrayRecord,
    scheme: Scheme,
    digest: str,
    reference: Tensors | None,
) -> Tensors:
    """x_hat + D(c), where x_hat must be the reference the download names and c one in the run's scheme."""
    if reference is None:
        raise DownloadError(
            "this site holds no reference model to apply a compressed download to (a new site, or one restarted "
            "without --state-dir); the coordinator sends the whole model after this refusal"
        )
    if download.get("base") != digest:
        raise DownloadError(
            f"the download is a change from reference {str(download.get('base'))[:12]}, but this site holds "
            f"{digest[:12]}; refused rather than applied to another model (the whole model comes next)"
        )
    if not scheme.enabled:
        raise DownloadError(
            "the download is compressed but the run's config names no scheme (compress none)"
        )
    shapes = download_shapes(scheme, download)
    if list(shapes.items()) != [(name, tuple(t.shape)) for name, t in reference.items()]:
        raise DownloadError("the download's tensors are not those of the site's reference model")
    decoded = decode(
        {name: array_view(array) for name, array in arrays.items()}, shapes, scheme, exact=True
    )
    return {name: reference[name] + decoded[name] for name in reference}


def site_references(
    context: Context, state_dir: Path | None = None
) -> dict[str, tuple[str, Tensors]]:
    """Per coordinates key, the digest and tensors of the reference the site holds, least recently rebuilt
    first: from `context.state`, else the state file (a restarted site)."""
    if STATE_ARRAYS in context.state:
        index, tensors = dict(context.state[STATE_CONFIG]), from_record(context.state[STATE_ARRAYS])
    elif state_dir is not None and (path := state_path(state_dir, context, "reference")).exists():
        text, tensors = read_state(path)
        index = json.loads(text)
    else:
        return {}
    models: list[Tensors] = [{} for _ in index["keys"]]
    for name, tensor in tensors.items():
        position, _, tensor_name = name.partition("/")
        models[int(position)][tensor_name] = tensor
    return {
        key: (digest, model)
        for key, digest, model in zip(index["keys"], index["digests"], models, strict=True)
    }


def _keep(context: Context, state_dir: Path | None, held: dict[str, tuple[str, Tensors]]) -> None:
    index = {"keys": list(held), "digests": [digest for digest, _ in held.values()]}
    tensors = {
        f"{i}/{name}": t for i, (_, model) in enumerate(held.values()) for name, t in model.items()
    }
    context.state[STATE_ARRAYS] = to_record(tensors)
    context.state[STATE_CONFIG] = ConfigRecord(index)
    if state_dir is not None:
        write_state(state_path(state_dir, context, "reference"), json.dumps(index), tensors)
