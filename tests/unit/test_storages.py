"""LiveStorages on real tensors: the hooks see each allocation, free, resize and host placement
exactly once, in order, and the storages are never kept alive."""

import gc
import weakref

import torch

from memfit.memory.storages import LiveStorages, returns_alias

aten = torch.ops.aten
F32 = 4


class Log:
    """Hooks that record every call; the token of a storage is the index of its allocation."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.storages = LiveStorages(self.allocated, self.freed, self.hosted)

    def allocated(self, t, nbytes, func, on_host):
        self.calls.append(("alloc", nbytes, on_host))
        return len(self.calls) - 1

    def freed(self, token):
        self.calls.append(("free", token))

    def hosted(self, token):
        self.calls.append(("host", token))
        return token


def test_allocation_free_and_views_share_one_storage():
    log = Log()
    a = torch.empty(10)
    log.storages.see(a)
    log.storages.see(a.view(2, 5))  # same storage: nothing new
    log.storages.see(a[3:])
    assert log.calls == [("alloc", 10 * F32, False)]
    assert log.storages.token(a[1:]) == 0
    del a
    assert log.calls == [("alloc", 10 * F32, False), ("free", 0)]
    assert log.storages.live == {}


def test_no_storage_is_kept_alive():
    log = Log()
    a = torch.empty(10)
    log.storages.see(a)
    ref = weakref.ref(a.untyped_storage())
    del a
    gc.collect()
    assert ref() is None and log.calls[-1] == ("free", 0)


def test_a_resize_frees_the_old_size_and_books_the_new_one_once():
    log = Log()
    a = torch.empty(10)
    log.storages.see(a)
    a.resize_(20)
    log.storages.see(a)
    log.storages.see(a)  # same size again: nothing new
    assert log.calls == [("alloc", 10 * F32, False), ("free", 0), ("alloc", 20 * F32, False)]
    del a  # only the reference of the latest size reports the free
    assert log.calls[3:] == [("free", 2)]


def test_host_placement_before_and_after_the_storage_is_seen():
    log = Log()
    seen, unseen = torch.empty(10), torch.empty(3)
    log.storages.see(seen)
    log.storages.host([seen, unseen])
    log.storages.host(seen)  # once is enough
    log.storages.see(unseen)
    assert log.calls == [("alloc", 10 * F32, False), ("host", 0), ("alloc", 3 * F32, True)]
    del unseen
    assert log.calls[-1] == ("free", 2) and list(log.storages.live) == [seen.untyped_storage()._cdata]


def test_see_outputs_skips_ops_that_return_an_alias():
    log = Log()
    a = torch.empty(4)
    log.storages.see_outputs(a, aten.empty.memory_format)
    log.storages.see_outputs(a.view(2, 2), aten.view.default)
    log.storages.see_outputs((a, torch.empty(2)), aten.split.Tensor)
    log.storages.see_outputs((torch.empty(1), [torch.empty(2)]), aten.var_mean.correction)
    assert [c[1] for c in log.calls if c[0] == "alloc"] == [4 * F32, 1 * F32, 2 * F32]
    assert returns_alias(aten.add_.Tensor) and returns_alias(aten.add.out)
    assert not returns_alias(aten.add.Tensor) and not returns_alias(aten.lift_fresh.default)
