"""The fleet store: every operation kvfleet runs on Redis (engine presence, KV-block index, tenants and
API keys, model policy, tokenizers, wake locks, admission and usage), over the key contract of
``kvfleet_common.redis_keys``.

Layout:
- ``runner``: how an operation runs. Each operation is written once, as a generator (``Op``) that yields
  *round trips* (``Eval``: one Lua script; ``Batch``: one pipeline) and receives their replies; one sync
  and one async runner execute them. Also the Lua loader, the client reconnect policy and the errors.
- one module per concern (``replicas``, ``kv_index``, ``admission``, ``model_load``, ``tenants``,
  ``model_policy``, ``tokenizers``, ``wake_locks``) holding its ``op_*`` generators and pure helpers (tested without Redis);
- ``store``: the front ends ``FleetStore`` (sync ``redis.Redis``: the engine's presence thread, scripts,
  tests) and ``AsyncFleetStore`` (``redis.asyncio.Redis``: gateway, operator), the same typed methods,
  each running one concern's generator.
- ``lua/*.lua``: the scripts, one operation each, loaded with importlib.resources.

Invariants kept here:
- key names come from one place, ``redis_keys``, Lua included: a script gets every key it touches as
  ``KEYS``, or, for keys of ids it reads inside Redis, a ``redis_keys.KeyTemplate`` as two ``ARGV``
  entries; no ``.lua`` file spells a key name, a key prefix or a key separator (a test checks it);
- a replica's heartbeat hash, its block set and its name record expire together (one TTL,
  refreshed by every heartbeat); everything a replica writes vanishes if it dies;
- the block set changes only through scripts that first check the heartbeat exists and that the
  events continue the sequence the index already reflects (``kv_seq_applied``); otherwise the
  writer is told to resync, so the index is either exact or known to be behind;
- admission checks and takes in one script (request counted, tokens reserved, concurrency lease taken),
  so no burst gets past a limit; a lease expires unless its gateway renews it, so a dead gateway leaks
  no slot;
- work proportional to a large set never runs as one blocking command: sets are deleted with
  ``UNLINK`` (freed in the background) and uploaded in chunks.

Scripts build some key names from set members, so this targets standalone Redis (or Sentinel),
not Redis Cluster.
"""
