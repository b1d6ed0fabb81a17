"""Hydra-net mechanics: the part of a global transformer one site trains, and how to find it.

A Hydra-net is (1) a set of layers taken from a global ranking and (2) within each of them the attention heads
(KV groups under grouped-query attention) that matter most for the site's data. The width baselines (HeteroFL,
FjORD, FedRolex) slice channels of every head instead.

Pure modules, which the coordinator and the strategies import (named arrays and a few floats, no model code):

- `spec`: `SubnetSpec`, the selection, and its codec into a flat Flower ConfigRecord.
- `slices`: `Slice`, the coordinates a subnetwork trains or reads, and moving exactly those (`extract`, `merge`).
- `width`: the width windows and the slices they give, from a layout a site reported.
- `planning`: global layer ranking, head selection, building specs, budgets from a site's measured cost.
- `families`: the one table of supported model families (module paths of attention and FFN), plain data.

Site modules, on live torch models:

- `architecture`: where a model keeps its layers and q/k/v/o projections (`find_architecture`).
- `apply`: applying a spec to a live model (`apply_spec`) and its exact trainable slices.
- `scoring`: layer and head importance on the site's own data.
- `measure`: the site's step time and memory (`measure_layer_cost`).
- `counts`: parameter, byte and FLOP counts of a model or a subnetwork of it.

This file imports nothing, so importing a pure module never loads site code.
"""
