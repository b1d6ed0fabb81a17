"""What one round of a run records, in every runtime: its metrics, timings, bytes and per-site counters, and
what privacy and security it had. `rounds.tsv`'s columns are the timing/bytes part; its per-site columns list
each site's bytes as `node:bytes` pairs in node order (comma-separated), so runtimes compare site by site."""

from __future__ import annotations

from dataclasses import dataclass, field

ROUNDS_TSV_COLUMNS = (
    "round",
    "duration_s",
    "aggregation_s",
    "gap_s",
    "sites_ok",
    "sites_failed",
    "bytes_up",
    "bytes_down",
    "bytes_up_per_site",
    "bytes_down_per_site",
)


def metric(value: float | None) -> str:
    """A loss or accuracy with four decimals, as logs and tables of rounds show it; "-" when not measured."""
    return "-" if value is None else f"{value:.4f}"


def per_site(counts: dict[str, int]) -> str:
    """A per-site column of `rounds.tsv`: `node:bytes` pairs in node order; "-" when no site had any."""
    return (
        ",".join(f"{node}:{counts[node]}" for node in sorted(counts, key=lambda n: (len(n), n)))
        or "-"
    )


def megabytes(count: int | None) -> str:
    """Bytes as MB with two decimals, as every table of rounds shows them (JSON keeps the bytes); "-" for a
    record stored without them."""
    return "-" if count is None else f"{count / 1e6:.2f}"


@dataclass(kw_only=True, slots=True)
class RoundRecord:
    round: int
    loss: float | None = None
    accuracy: float | None = None
    train_loss: float | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    seconds: float = 0.0
    aggregation_s: float = 0.0
    gap_s: float = 0.0
    sites_ok: int = 0
    sites_failed: int = 0
    bytes_up_per_site: dict[str, int] = field(default_factory=dict)
    bytes_down_per_site: dict[str, int] = field(default_factory=dict)
    data_hash_per_site: dict[str, str] = field(default_factory=dict)
    """Per node id, the SHA-256 of the ordered sample ids of the site's global batches this round."""
    trainable_params_per_site: dict[str, int] = field(default_factory=dict)
    """Per node id, the coordinates the site trained this round (its reply's `trainable-params`)."""
    peak_memory_per_site: dict[str, int] = field(default_factory=dict)
    """Per node id, the site's peak training memory in bytes (`hydrafl.footprint`, its `peak-memory-bytes`)."""
    noise_scale: float | None = None
    """Diagnostics: B_pg = tr(Cov[delta_site]) / ||mean delta||^2 over this round's valid replies."""
    full_data_cosine: float | None = None
    """Diagnostics: cosine between the averaged delta and the full-data reference site's delta."""
    dp_epsilon: float | None = None
    """Central DP: the run's epsilon after this round (at the run's `dp_delta`), from the Renyi DP accountant."""
    dp_epsilon_exact: float | None = None
    """Central DP: the same from the exact (PLD) accountant; `hydrafl.privacy.accountant` says which is tighter."""
    dp_clip: float | None = None
    """Central DP: the clipping bound this round used (it moves with adaptive clipping)."""
    dp_noise_multiplier: float | None = None
    """Central DP: the noise multiplier the round is accounted with; with secure aggregation, the effective one of
    the noise its surviving sites added (`hydrafl.secagg.noise`)."""
    dp_sites_available: int = 0
    """Central DP: the sites the round could sample (the accountant's population; its sample: the messages)."""
    local_epsilon_per_site: dict[str, float] = field(default_factory=dict)
    """Per node id, the epsilon the site's own policy noise has spent so far (local DP, the site's accountant)."""
    rejected_per_site: dict[str, str] = field(default_factory=dict)
    """Per node id, why screening rejected the site's reply this round."""
    secagg_bytes: int = 0
    """Secure aggregation: bytes of the protocol's own messages this round (keys, shares, unmasking)."""
    secagg_s: float = 0.0
    """Secure aggregation: seconds of the protocol's own stages this round (masking overhead excluded)."""
    virtual_s: float | None = None
    """Asynchronous runs in simulation: the virtual clock at this step (a site's local round lasts 1 / its speed)."""
    staleness: list[int] = field(default_factory=list)
    """Asynchronous runs: each buffered update's staleness (model versions between its start and this step)."""
    update_weights: list[float] = field(default_factory=list)
    """Asynchronous runs: each buffered update's weight (staleness factor x examples / mean examples, capped)."""
    ess: float | None = None
    """Asynchronous runs: the buffer's effective number of sites (`strategies.staleness.ess`)."""
    oldest_open: int | None = None
    """Asynchronous runs: the oldest model version a site still trains on; its messages must be kept."""

    def tsv_row(self) -> str:
        values = {
            "round": self.round,
            "duration_s": f"{self.seconds:.4f}",
            "aggregation_s": f"{self.aggregation_s:.4f}",
            "gap_s": f"{self.gap_s:.4f}",
            "sites_ok": self.sites_ok,
            "sites_failed": self.sites_failed,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "bytes_up_per_site": per_site(self.bytes_up_per_site),
            "bytes_down_per_site": per_site(self.bytes_down_per_site),
        }
        return "\t".join(str(values[column]) for column in ROUNDS_TSV_COLUMNS)
