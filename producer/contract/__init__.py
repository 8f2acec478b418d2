"""The wire contract between producers, workers, the gateway and their Lua scripts.

One home per idea, importable without torch (and, but for `schema`, without pydantic):

- `keys`: every Redis key, channel, job-hash field and TTL default (pagedq's and RQ's layout);
- `ids`: job ids (random, or derived from a custom_id and the request);
- `models`: model aliases and canonical model names;
- `routing`: which queue a job waits in (model, priority, tenant) and its estimated cost;
- `shards`: queue shards and their hash tags (which Redis Cluster slot a job's keys live in);
- `schema`: the job and result schemas, and the table of sampling fields;
- `codec`: reading a job's `data` safely (bounded zlib, JSON only);
- `lua`: Lua scripts with named KEYS/ARGV and the key prefixes they may use.

Nothing else declares a key name, a TTL default or a model alias; tests/test_contract.py
checks that.
"""
