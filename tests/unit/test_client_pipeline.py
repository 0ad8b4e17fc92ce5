"""The put pipeline's pure parts: how a put's answers are counted (durable or not), and how each data
path cuts a put into Reserve groups and Commit runs."""

from kvstore_client.data_path import NETWORK_SHAPE, PipelineShape
from kvstore_client.pipeline import changed_pages, commit_runs, stored_pages
from kvstore_client import packed
from kvstore_client.proto import pb
from kvstore_client.shm_transport import HASHING_SHAPE, SHAPE as SHM_SHAPE

R, P, F, M, N = pb.RESERVED, pb.PRESENT, pb.IN_FLIGHT, pb.PARENT_MISSING, pb.NO_SPACE
C, X = pb.COMMITTED, pb.COMMIT_PARENT_MISSING


def commit(*states, durable_pages=0):
    return pb.CommitResponse(states=list(states), durable_pages=durable_pages)


def test_present_and_in_flight_pages_count_and_reserved_ones_count_once_committed():
    answers = [commit(C, C), commit(C)]
    assert stored_pages([P, R, R, F, R], answers, durable=False) == 5
    assert stored_pages([P, R, R, F, R], [commit(C, X), commit(C)], durable=False) == 2
    assert stored_pages([R, R, N, R], [commit(C, C, C)], durable=False) == 2
    assert stored_pages([M, M], [], durable=False) == 0
    assert stored_pages([R, R, R], [commit(C, C, C)], durable=False) == 3
    assert stored_pages([R, R, R], [commit(C, C), commit(X)], durable=False) == 2


def test_packed_commit_answers_count_as_repeated_ones_do():
    def packed(*states, durable_pages=0):
        return pb.CommitResponse(states_packed=bytes(states), durable_pages=durable_pages)
    assert stored_pages([P, R, R, F, R], [packed(C, C), packed(C)], durable=False) == 5
    assert stored_pages([P, R, R, F, R], [packed(C, X), packed(C)], durable=False) == 2
    assert stored_pages([P, R, R], [packed(C, C, durable_pages=1)], durable=True) == 2


def test_a_commit_answer_missing_for_a_reserved_page_ends_the_count():
    assert stored_pages([R, R, R], [commit(C, C)], durable=False) == 2


def test_durable_counts_written_pages_only_up_to_each_commits_durable_pages():
    states = [P, R, R, F, R]
    assert stored_pages(states, [commit(C, C, durable_pages=2), commit(C, durable_pages=1)], durable=True) == 5
    assert stored_pages(states, [commit(C, C, durable_pages=1), commit(C, durable_pages=1)], durable=True) == 2
    assert stored_pages(states, [commit(C, C), commit(C)], durable=True) == 1   # nothing on NVMe: only the present page
    assert stored_pages([P, F], [], durable=True) == 2                         # nothing written, nothing to wait for


def test_shared_memory_groups_small_pages_and_commits_short_runs():
    assert (SHM_SHAPE.group_pages(4 << 10), SHM_SHAPE.run_pages(4 << 10)) == (512, 512)
    assert (SHM_SHAPE.group_pages(64 << 10), SHM_SHAPE.run_pages(64 << 10)) == (128, 32)
    assert (SHM_SHAPE.group_pages(4 << 20), SHM_SHAPE.run_pages(4 << 20)) == (32, 1)


def test_where_the_sdk_hashes_as_it_copies_a_commit_covers_32_mib_or_128_small_pages():
    assert [HASHING_SHAPE.run_pages(p) for p in (4 << 10, 64 << 10, 1 << 20, 4 << 20)] == [128, 128, 32, 8]
    assert HASHING_SHAPE.reserve_groups(1024, 4 << 10) == [(0, 128), (128, 640), (640, 1024)]
    assert HASHING_SHAPE.reserve_groups(128, 64 << 10) == [(0, 128)]        # no short first group of larger pages
    assert HASHING_SHAPE.reserve_groups(40, 1 << 20) == [(0, 32), (32, 40)]
    assert HASHING_SHAPE.reserve_groups(32, 4 << 20) == [(0, 32)]
    assert commit_runs(HASHING_SHAPE.run_pages(4 << 10), 384, 4 << 10, last=True) == [(0, 128), (128, 256), (256, 384)]


def test_a_put_over_shared_memory_reserves_2_mib_first_then_whole_groups():
    assert SHM_SHAPE.reserve_groups(1024, 4 << 10) == [(0, 512), (512, 1024)]          # 512 pages are 2 MiB
    assert SHM_SHAPE.reserve_groups(128, 64 << 10) == [(0, 32), (32, 128)]
    assert SHM_SHAPE.reserve_groups(40, 1 << 20) == [(0, 2), (2, 34), (34, 40)]
    assert SHM_SHAPE.reserve_groups(32, 4 << 20) == [(0, 1), (1, 32)]                  # never less than a page
    assert SHM_SHAPE.reserve_groups(10, 64 << 10) == [(0, 10)]
    assert NETWORK_SHAPE.reserve_groups(1024, 4 << 10) == [(0, 1024)]                  # no short first group


def test_a_puts_last_group_ends_with_a_commit_of_its_last_mib_and_other_groups_commit_in_runs():
    assert commit_runs(512, 96, 64 << 10, last=True) == [(0, 80), (80, 96)]          # 16 pages of 64 KiB: 1 MiB
    assert commit_runs(512, 96, 64 << 10, last=False) == [(0, 96)]
    assert commit_runs(8192, 512, 4 << 10, last=True) == [(0, 256), (256, 512)]       # halves, as before
    assert commit_runs(8192, 300, 4 << 10, last=True) == [(0, 300)]                   # under two tails: whole
    assert commit_runs(8, 31, 4 << 20, last=True) == [(0, 8), (8, 16), (16, 24), (24, 30), (30, 31)]
    assert commit_runs(32, 1, 1 << 20, last=True) == [(0, 1)]
    assert commit_runs(32, 0, 1 << 20, last=True) == []                              # nothing reserved


def test_shared_memory_acquires_a_long_get_in_a_few_parts_and_the_network_in_one():
    assert [SHM_SHAPE.acquire_part_pages(n) for n in (1, 64, 128, 1024, 8192)] == [64, 64, 64, 256, 2048]
    assert [NETWORK_SHAPE.acquire_part_pages(n) for n in (1, 1024)] == [1, 1024]


def test_network_paths_group_by_bytes_and_commit_larger_runs():
    assert (NETWORK_SHAPE.group_pages(64 << 10), NETWORK_SHAPE.run_pages(64 << 10)) == (1024, 256)
    assert (NETWORK_SHAPE.group_pages(128 << 20), NETWORK_SHAPE.run_pages(128 << 20)) == (1, 1)
    assert PipelineShape(4, 1 << 20, 1).group_pages(1 << 20) == 4
    assert PipelineShape(4, 1 << 20, 1, reserve_group_pages_max=8).group_pages(1 << 10) == 8


def test_pages_whose_copy_hashes_differ_from_their_commit_are_named_by_index():
    acquired = pb.AcquireResponse(hit_pages=4, checksums=[11, 12, 13, 14])
    assert changed_pages(acquired, None) == []                  # nothing hashed as it landed (another data path)
    assert changed_pages(acquired, [11, 12, 13, 14]) == []
    assert changed_pages(acquired, [11, 99, 13, 98]) == [1, 3]
    assert changed_pages(acquired, [None] * 4) == []            # each vouched for by the node (tcp_framing.VOUCHED)
    assert changed_pages(acquired, [None, 99, 13, None]) == [1]


def test_pages_hashed_as_uint64s_are_checked_against_either_form_of_the_answer():
    """copy_out_hashed_rows' checksums (a view of uint64s) against a packed answer and a repeated one."""
    landed = lambda *sums: memoryview(packed.u64s(sums)).cast("Q")
    for acquired in (pb.AcquireResponse(hit_pages=4, checksums_packed=packed.u64s([11, 12, 13, 2**64 - 1])),
                     pb.AcquireResponse(hit_pages=4, checksums=[11, 12, 13, 2**64 - 1])):
        assert changed_pages(acquired, landed(11, 12, 13, 2**64 - 1)) == []
        assert changed_pages(acquired, landed(11, 99, 13, 2**64 - 2)) == [1, 3]
        assert changed_pages(acquired, landed(11, 12)) == []                 # a part: the first pages
        assert changed_pages(acquired, landed(11, 13)) == [1]
