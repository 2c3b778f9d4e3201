"""Token ids cut into uneven groups, as a detokenizer may be fed them (the detokenizer tests)."""


def groups(ids, rng, most=4):
    """ids cut into consecutive groups of 1..most tokens."""
    i = 0
    while i < len(ids):
        n = rng.randint(1, most)
        yield ids[i:i + n]
        i += n
