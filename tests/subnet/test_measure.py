"""A site's measured step cost: what bypassing moves between the fixed and the per-layer cost."""

from __future__ import annotations

import torch.nn.functional as F

from hydrafl.subnet.measure import measure_layer_cost


def test_a_bypassing_hydra_net_measures_no_fixed_cost_for_the_layers_it_skips(bert, text_batch):
    """Frozen layers below the top one still hold activations for the embeddings' gradient; skipped ones do not,
    so their share moves from the fixed cost into the per-layer one."""
    x, y = text_batch
    loss = lambda: F.cross_entropy(bert(x), y)  # noqa: E731
    frozen, skipped = (
        measure_layer_cost(bert, loss, "adamw", bypass=bypass) for bypass in (False, True)
    )
    assert (
        skipped.fixed_bytes < frozen.fixed_bytes
        and skipped.per_layer_bytes > frozen.per_layer_bytes
    )
