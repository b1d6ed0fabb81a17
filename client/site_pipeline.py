"""What a site does with one message, in every runtime: a compressed download is rebuilt into its model
(`hydrafl.compression.reference`), the ClientApp answers, then the site operator's policy shapes what may
leave (small cells, clipping, noise, privacy budget), then a train reply is compressed as the run asks
(`hydrafl.compression.feedback`) or, under secure aggregation, masked (train and evaluate replies). The site
agent, the in-process simulation grid and Ray's simulated sites (`PipelineApp`) all answer through here, so a
simulated site behaves as a real one."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from flwr.app import Context, Error, Message
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from hydrafl import protocol
from hydrafl.client import site_secagg
from hydrafl.client.exchange_folder import ExchangeFolder
from hydrafl.client.site_policy import SMALL_CELL_REASON, SitePolicy
from hydrafl.compression.layout import DOWNLOAD_RECORD, CompressionError, Scheme
from hydrafl.run_settings import run_settings
from hydrafl.secagg.identity import SiteIdentity, new_signing_key

log = logging.getLogger(__name__)


def answer(
    client_app: ClientApp,
    message: Message,
    context: Context,
    policy: SitePolicy,
    exchange: ExchangeFolder | None = None,
) -> Message:
    """The reply that leaves the site: the app's, after the policy, and under secure aggregation masked (the
    protocol's own queries are answered here, the app never sees them; a masked vector larger than `exchange`'s
    memory bound is written into one of its files)."""
    if message.metadata.message_type in protocol.SECAGG_QUERIES:
        return site_secagg.answer_query(message, context)
    if DOWNLOAD_RECORD in message.content and (refusal := _download_refusal(message, context)):
        return refusal
    if refusal := policy.budget_refusal(message, context):
        return policy.decline(message, refusal)
    if _has_small_cells(message, context, policy):
        return policy.decline(message, SMALL_CELL_REASON)
    if site_secagg.is_secagg_reply(message):
        routed = site_secagg.take_record(message)
        reply = policy.release(client_app(message=message, context=context), context)
        return site_secagg.masked_reply(message, reply, context, routed, exchange=exchange)
    reply = policy.release(client_app(message=message, context=context), context)
    return _compressed(message, reply, context)


def _compressed(message: Message, reply: Message, context: Context) -> Message:
    """`compress_reply`, whose codecs (and torch) load only for a run that compresses: the in-process grid
    answers through here, and a stock Flower app's simulation need not import torch."""
    if reply.has_error() or not message.metadata.message_type.startswith("train"):
        return reply
    if not Scheme.from_config(run_settings(message, context)).enabled:
        return reply
    from hydrafl.compression.feedback import compress_reply

    return compress_reply(message, reply, context)


def _download_refusal(message: Message, context: Context) -> Message | None:
    """A compressed download (`--compress-downloads`) turned into its model in place; the error reply instead
    when the site cannot rebuild it exactly (the coordinator then sends the whole model)."""
    from hydrafl.compression.reference import (
        DownloadError,
        receive_download,
    )  # torch: only for a run that uses it

    try:
        receive_download(message, context)
    except (DownloadError, CompressionError) as error:
        log.warning("refusing a %s message's download: %s", message.metadata.message_type, error)
        return Message(
            Error(ErrorCode.MOD_FAILED_PRECONDITION, f"download refused: {error}"), reply_to=message
        )
    return None


def _has_small_cells(message: Message, context: Context, policy: SitePolicy) -> bool:
    """Whether the policy's min-class-count refuses this train message's data; the classes and counts that
    break it go to the site's log only."""
    if policy.min_class_count is None or not message.metadata.message_type.startswith("train"):
        return False
    from hydrafl.client.site_app import (
        train_class_counts,  # the site's data, read here only for a policy that counts it
    )

    detail = policy.small_cell_refusal(train_class_counts(message, context))
    if detail:
        log.warning("site policy min-class-count: %s", detail)
    return bool(detail)


class PipelineApp(ClientApp):
    """`inner` answering through `answer` under `policy`, as one ClientApp: for runtimes that call the ClientApp
    themselves, like Flower's Ray simulation engine. It pickles to Ray's actors with its app and policy (both
    importable or plain data), and the secure-aggregation session and the privacy count stay in the
    `context.state` the engine keeps per node across messages. It plays the consortium for its sites: each
    gets a certified secure-aggregation identity the first time it answers (the engine picks the node ids)."""

    def __init__(
        self, inner: ClientApp, policy: SitePolicy, run_config: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.inner, self.policy, self.run_config = inner, policy, dict(run_config or {})
        self.consortium = new_signing_key()

    def __call__(self, message: Message, context: Context) -> Message:
        if not context.run_config and self.run_config:
            # Ray's engine gives sites no run_config and forbids changing it: the app sees the run's in a
            # Context of its own that shares the node's state, so what it keeps there persists
            context = Context(
                run_id=context.run_id,
                node_id=context.node_id,
                node_config=context.node_config,
                state=context.state,
                run_config=dict(self.run_config),
            )
        if site_secagg.IDENTITY_KEY not in context.state:
            site_secagg.install_identity(
                context, SiteIdentity.issue(self.consortium, context.node_id)
            )
        return answer(self.inner, message, context, self.policy)
