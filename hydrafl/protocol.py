"""What the coordinator and a site say to each other: message types, the keys of their records, gRPC options.

Both ends import this module and nothing else of each other, so a key is spelled once. It imports neither
torch nor Flower: the coordinator, the site agent and the strategies all read it.
"""

from __future__ import annotations

# Message types beyond Flower's train / evaluate.
QUERY_INIT = "query.init"
"""Asks a site for the seeded initial model (one ArrayRecord back)."""
QUERY_CURVATURE = "query.curvature"
"""Asks a site for its loss curvature (the outer-optimizer stability check)."""
QUERY_SCORES = "query.scores"
"""Asks a site for its layer and head importance, tier, resources and slice layout (the planning round)."""
QUERY_SECAGG_KEYS = "query.secagg_keys"
"""Secure aggregation, setup: a site makes its round keys and answers with its public keys."""
QUERY_SECAGG_SHARES = "query.secagg_shares"
"""Secure aggregation, share keys: a site answers with encrypted shares of its secrets, one per neighbour."""
QUERY_SECAGG_CHECK = "query.secagg_check"
"""Secure aggregation, consistency check: a survivor answers with its signature over the survivor set."""
QUERY_SECAGG_UNMASK = "query.secagg_unmask"
"""Secure aggregation, unmask: a survivor answers with the shares that remove the masks."""
QUERY_DEDUP_SIGNATURES = "query.dedup_signatures"
"""Deduplication: a site answers with the keyed MinHash signatures of its training records (`DEDUP_NUM_PERM`
permutations each) and its key check."""
QUERY_DEDUP_DROP = "query.dedup_drop"
"""Deduplication: the message carries the training rows this site drops (`DEDUP_DROP`); the site keeps the list
for the run and answers with its remaining records."""
QUERY_STATS = "query.stats"
"""Asks a site for its cohort statistics (`hydrafl.cohort_stats`), released as its policy says."""
STATS_RECORD = "stats"
"""The ConfigRecord of a statistics reply; its `STATS_REPORT` key holds the report's JSON."""
STATS_REPORT = "report"
SECAGG_QUERIES = (QUERY_SECAGG_KEYS, QUERY_SECAGG_SHARES, QUERY_SECAGG_CHECK, QUERY_SECAGG_UNMASK)

# Config keys the coordinator adds to a message for one site.
SERVER_ROUND = "server-round"
"""The round a train message belongs to (Flower's strategies set it too)."""
MODEL_VERSION = "model-version"
"""Asynchronous runs (FedBuff): the version of the model a train message carries (the coordinator's own record of
it, kept per message, is what counts)."""
SUBNET_PREFIX = "hydra."
"""Keys of the SubnetSpec a site trains (`SubnetSpec.to_config`)."""
SITE_RANK = "lora.site-rank"
"""The LoRA rank a site trains and uploads."""
LORA_BASES = "lora.own-bases"
"""Init query: the frozen base weights of the LoRA modules travel with the adapters (FLoRA merges into them)."""
TAIL_PENALTY = "hetlora.tail-penalty"
"""HetLoRA: lambda of the site's local regulariser on its rank's tail (absent = none)."""
TAIL_PRUNE = "hetlora.prune"
"""HetLoRA: the fraction of a site's rank that is its tail."""
SCORE_SAMPLES = "scoring.samples"
"""Scoring query: how many training samples the site scores on."""
LAYER_SCORE = "scoring.layer-method"
"""Scoring query: layer importance method (fisher or taylor)."""
HEAD_SCORE = "scoring.head-method"
"""Scoring query: head importance method (taylor or confidence)."""
MAGNITUDE_SCORE = "magnitude"
"""Scoring method of a private run (central DP or secure aggregation), for layers and heads: from the model's
weights alone, so the planning round releases nothing about a site's data."""
SCORE_BYPASS = "scoring.bypass"
"""Scoring query: the site measures its step cost with layers outside its net skipped rather than frozen."""
SCORE_RANK_COST = "scoring.rank-cost"
"""Scoring query (LoRA baselines): the site also measures the step cost of a rank-r adapter (`RankCost`)."""
RUN_EPSILON = "dp.run-epsilon"
"""Train message: the epsilon the run's central DP will have spent after this round (absent: no central DP,
an infinite spend); a site with a privacy budget refuses a round that would take it over."""

SECAGG_RECORD = "secagg"
"""The ConfigRecord of every secure-aggregation message, both ways (`hydrafl.secagg.wire` fields); in a train
message it carries the encrypted shares routed to the site."""
SECAGG_MASKED = "secagg.masked"
"""Secure aggregation: the one array (uint32) of a train or evaluate reply, the site's masked encoded update
and metrics (nothing else travels in the clear)."""

DEDUP_NUM_PERM = "dedup.num-perm"
"""Signatures query: how many MinHash permutations each signature has."""
DEDUP_DROP = "dedup.drop"
"""Drop query: the array (int64) of the site's training rows to drop."""

# Record keys of a site's replies.
WEIGHT = "num-examples"
"""The weight of a reply in an average (Flower's `weighted_by_key` default)."""
DATA_HASH = "data-hash"
"""Train reply ConfigRecord: SHA-256 of the ordered sample ids the site trained on this round."""
LOCAL_EPSILON = "dp.local-epsilon"
"""Train reply ConfigRecord: the epsilon the site's own policy noise has spent so far (local DP). Not a metric:
Flower's aggregation drops replies whose metric names differ."""
TRAINABLE_PARAMS = "trainable-params"
"""Train reply metric: the coordinates the site trained."""
PEAK_MEMORY = "peak-memory-bytes"
"""Train reply metric: the site's peak training memory."""
MEMORY_BYTES = "memory-bytes"
"""Scoring reply metric: the training memory the site declares (0 = no limit)."""
COST_PREFIX = "cost."
"""Scoring reply metrics: the site's measured step cost (`LayerCost` fields, dashes for underscores)."""
RANK_COST_PREFIX = "rank-cost."
"""Scoring reply metrics: a LoRA site's measured step cost per rank (`RankCost` fields, dashes for underscores)."""
LAYER_PREFIX = "layer-"
"""Scoring reply metrics `layer-L`: importance of layer L."""
HEAD_PREFIX = "head-"
"""Scoring reply metrics `head-L-G`: importance of KV group G of layer L."""
EXPERT_PREFIX = "expert-"
"""Scoring reply metrics `expert-L-E`: share of the site's tokens layer L's router sends to expert E (from the
weights in a private run: the squared norm of the expert's router row)."""
COACTIVATION_PREFIX = "coact-"
"""Scoring reply metrics `coact-L-I-J` (I < J): share of the site's tokens routed to both experts I and J."""
SITE_RECORD = "site"
"""Scoring reply ConfigRecord: the site's tier and slice layout."""
TIER = "tier"
LAYOUT_NAMES = "layout.names"
LAYOUT_LAYERS = "layout.layers"
LAYOUT_AXES = "layout.axes"
LAYOUT_UNITS = "layout.units"

DEDUP_SIGNATURES = "dedup.signatures"
"""Signatures reply: the array (uint32 [records, permutations]) of keyed MinHash signatures."""
DEDUP_KEY_CHECK = "dedup.key-check"
"""Signatures reply ConfigRecord: the site's key check, equal at two sites exactly when their keys are."""
DEDUP_DROPPED = "dedup.dropped"
"""Drop reply metric: the training records the site dropped."""

MAX_GRPC_MESSAGE_BYTES = 8 << 20
"""Arrays travel as chunk streams, so no single gRPC message needs more."""
GRPC_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
)
"""Channel options both ends use; the server adds its own on top (`server.service`)."""
