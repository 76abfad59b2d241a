from __future__ import annotations

from kvlab.instrument.sanitizer import KVSanitizer, Violation, prefix_digests


def test_explain_names_reader_block_slot_writer_and_step():
    san = KVSanitizer(num_blocks=8, block_size=16)
    san.record_write("A", [50], [9], [2], step=4)
    [v] = san.check_read("B", [50], [17], [2], step=7)
    assert v == Violation(7, "B", 3, 50, 2, 17, 9, 2, "A", 4)
    assert v.explain() == (
        "step 7: request B read block 3 slot 50 (pos 2): expected token 17 at pos 2, "
        "found token 9 at pos 2 written by request A at step 4"
    )
    assert san.violations == [v]


def test_own_and_identical_shared_content_are_fine_foreign_content_is_not():
    san = KVSanitizer(4, 4)
    a = [5, 6, 7]
    san.record_write("A", [0, 1, 2], a, [0, 1, 2], step=1, context=prefix_digests(a))
    # B shares A's prefix: same tokens, positions and prefixes, another writer -- that is prefix caching.
    assert san.check_read("B", [0, 1, 2], a, [0, 1, 2], step=2, context=prefix_digests(a)) == []
    # Same token and position after a different prefix is foreign state.
    b = [4, 6, 7]
    bad = san.check_read("B", [0, 1, 2], b, [0, 1, 2], step=2, context=prefix_digests(b))
    assert [v.position for v in bad] == [0, 1, 2]
    assert "different prefix" in bad[1].explain()
    # Without the prefix digest only token and position can be compared.
    assert [v.position for v in san.check_read("B", [0, 1, 2], b, [0, 1, 2], step=2)] == [0]
    # A wrong position is caught too.
    assert len(san.check_read("A", [1], [6], [5], step=3)) == 1


def test_unwritten_slot_and_copies_and_reset():
    san = KVSanitizer(4, 2)
    [v] = san.check_read("A", [3], [1], [0], step=1)
    assert v.found_token is None and v.writer is None and "never written" in v.explain()
    san.record_write("A", [0, 1], [1, 2], [0, 1], step=1)
    san.copy_blocks([(0, 3)])
    assert san.check_read("B", [6, 7], [1, 2], [0, 1], step=2) == []
    assert san.violations
    san.reset()
    assert san.violations == []
    assert len(san.check_read("B", [6], [1], [0], step=3)) == 1


def test_prefix_digests_depend_on_the_whole_prefix():
    d = prefix_digests([1, 2, 3])
    assert prefix_digests([3], start=d[1]) == d[2:]
    assert prefix_digests([2, 1, 3])[2] != d[2]
