"""Operator-wide handlers (kopf activities): logging in, and closing the clients at the end."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from kvfleet_operator.handlers.context import OperatorMemo
from kvfleet_operator.handlers.peering import watch_peering


async def log_in(
    memo: OperatorMemo, logger: logging.Logger, settings: kopf.OperatorSettings, **kwargs: Any
) -> kopf.ConnectionInfo | None:
    """kopf's credentials, which the operator's own Kubernetes client reuses (`OperatorContext.kube`).

    Without auth against `--server` (tests); else the service account, a configured kubernetes client, or
    the kubeconfig. With peering, also starts the watch that reports a missing peering object."""
    context = memo.context
    if context.options.server:
        info = kopf.ConnectionInfo(server=context.options.server, insecure=True, default_namespace="default")
    else:
        info = (
            kopf.login_with_service_account(settings=settings, logger=logger, **kwargs)
            or kopf.login_via_client(settings=settings, logger=logger, **kwargs)
            or kopf.login_with_kubeconfig(settings=settings, logger=logger, **kwargs)
        )
    context.connection = info
    if context.options.peering is not None and context.peering_watch is None:
        context.peering_watch = asyncio.get_running_loop().create_task(watch_peering(context))
    return info


async def close_clients(memo: OperatorMemo, **_: Any) -> None:
    await memo.context.close()
