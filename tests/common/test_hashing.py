import xxhash

from kvfleet_common.hashing import hash_block, hash_blocks, root_hash


def test_matches_the_documented_formula():
    salt = b"tenant-a"
    h0 = xxhash.xxh3_128_digest(b"kvfleet" + salt)
    block = [1, 2, 3, 70000]
    expected = xxhash.xxh3_128_digest(h0 + b"".join(t.to_bytes(4, "little") for t in block))
    assert root_hash(salt) == h0
    assert hash_blocks([*block, 9, 9], block_size=4, salt=salt) == [expected]


def test_chain_names_the_whole_prefix():
    a = hash_blocks(list(range(32)), 8)
    b = hash_blocks([99, *list(range(1, 32))], 8)
    assert len(a) == 4 and len(set(a)) == 4
    assert all(x != y for x, y in zip(a, b))  # one changed token changes every later block


def test_salt_and_extra_separate_caches():
    toks = list(range(16))
    assert hash_blocks(toks, 16) != hash_blocks(toks, 16, salt="t1")
    assert hash_blocks(toks, 16) != hash_blocks(toks, 16, extra=b"lora:1")


def test_partial_block_not_hashed_and_chain_continues():
    toks = list(range(40))
    full = hash_blocks(toks, 16)
    assert len(full) == 2
    head = hash_blocks(toks[:16], 16)
    assert hash_blocks(toks[16:], 16, parent=head[-1]) == full[1:]
    assert hash_block(full[0], toks[16:32]) == full[1]
