"""torch's global oneDNN switch under the single-row tuning: one owner for the process, so threads,
nesting and interrupts leave it as the user set it, and a user's "off" is never touched."""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

from tiny_models import save_tiny_llama
from whichdevice.tuning import onednn
from whichdevice.tuning.onednn import holders, onednn_off
from whichdevice.tuning.single_row import install_single_row


def _enabled() -> bool:
    return bool(torch._C._get_mkldnn_enabled())


@pytest.fixture(autouse=True)
def _switch_back_on():
    yield
    torch.backends.mkldnn.enabled = True


def test_the_first_holder_turns_it_off_and_the_last_turns_it_back_on():
    assert _enabled() and holders() == 0
    with onednn_off() as outer:
        assert outer and not _enabled() and holders() == 1
        with onednn_off() as inner:
            assert inner and not _enabled() and holders() == 2
        assert not _enabled() and holders() == 1  # the inner one let go: the outer still holds
    assert _enabled() and holders() == 0


def test_a_users_off_is_never_held_and_stays_off():
    torch.backends.mkldnn.enabled = False
    with onednn_off() as held:
        assert not held and holders() == 0 and not _enabled()
    assert not _enabled()


def test_any_exit_lets_go_keyboard_interrupt_and_system_exit_included():
    for error in (RuntimeError, KeyboardInterrupt, SystemExit):
        with pytest.raises(error), onednn_off():
            raise error()
        assert _enabled() and holders() == 0


def test_a_switch_the_user_turned_on_meanwhile_stays_on():
    with onednn_off():
        torch.backends.mkldnn.enabled = True
    assert _enabled() and holders() == 0


def test_holders_in_threads_interleaved_leave_the_switch_on():
    # Each thread holds the switch and lets go at a different moment: the old save-and-restore per
    # forward put back another thread's "off" whenever the holds overlapped.
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def hold(delay_rounds: int) -> None:
        try:
            for _ in range(50):
                with onednn_off():
                    barrier.wait()
                    assert not _enabled()
                    for _ in range(delay_rounds):
                        pass
                barrier.wait()
        except BaseException as error:
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=hold, args=(i * 1000,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == [] and _enabled() and holders() == 0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    path = save_tiny_llama(tmp_path_factory.mktemp("onednn") / "tiny", dtype=torch.bfloat16, tokenizer=False)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    install_single_row(loaded)
    return loaded


@pytest.mark.parametrize("users", [True, False], ids=["user-on", "user-off"])
def test_threads_of_mixed_one_row_and_batch_forwards_leave_the_switch_as_the_user_set_it(model, users):
    """A server's thread pool: 6 threads, each round a mix of one-row steps and four-row prompts on one
    prepared model; after every round the switch is the user's, and no one-row forward of a user who
    keeps oneDNN on ran with it on."""
    one_row_saw: list[bool] = []
    hook = model.model.layers[0].register_forward_pre_hook(
        lambda module, args: one_row_saw.append(_enabled()) if args[0].shape[:2] == (1, 1) else None
    )
    try:
        torch.backends.mkldnn.enabled = users
        for round_ in range(8):
            errors: list[BaseException] = []

            def work(i: int, round_: int = round_, errors: list[BaseException] = errors) -> None:
                rows = 1 if (i + round_) % 2 else 4
                ids = torch.randint(3, 200, (rows, 1 if rows == 1 else 6), generator=torch.Generator().manual_seed(i))
                try:
                    with torch.inference_mode():
                        for _ in range(3):
                            model(input_ids=ids)
                except BaseException as error:
                    errors.append(error)

            threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=120)
            assert errors == []
            assert _enabled() is users and holders() == 0, f"round {round_}"
    finally:
        hook.remove()
    assert one_row_saw and not any(one_row_saw)  # every one-row forward ran without oneDNN


def test_two_threads_generating_at_batch_one_leave_onednn_on(model, tmp_path):
    """The case users hit: two requests served at once, each a batch-1 generate on its own prepared
    model (the hooks of before left oneDNN off in 3 of 12 such rounds here, 8 of 12 on another VM)."""
    path = save_tiny_llama(tmp_path / "other", dtype=torch.bfloat16, tokenizer=False)
    other = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    install_single_row(other)
    for _ in range(12):
        threads = [
            threading.Thread(
                target=lambda each=each, seed=seed: each.generate(
                    torch.randint(3, 200, (1, 5), generator=torch.Generator().manual_seed(seed)),
                    max_new_tokens=40,
                    do_sample=False,
                    pad_token_id=0,
                )
            )
            for seed, each in enumerate((model, other))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert _enabled() and holders() == 0


def _forked(check: Callable[[], bool], timeout_s: float = 60.0) -> str:
    """Run ``check`` in a forked child: "ok", "failed" or "hung" (killed after ``timeout_s``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork of a threaded process: what the test is about
        pid = os.fork()
    if pid == 0:  # the child: only this thread exists here
        code = 1
        try:
            code = 0 if check() else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return "ok" if os.waitstatus_to_exitcode(status) == 0 else "failed"
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "hung"


def _child_starts_with_the_switch_on_and_can_hold_it() -> bool:
    if not (_enabled() and holders() == 0):
        return False
    with onednn_off() as held:
        if not (held and not _enabled()):
            return False
    return _enabled() and holders() == 0


def _while_another_thread(hold: Callable[[threading.Event, threading.Event], None]) -> str:
    holding, release = threading.Event(), threading.Event()
    thread = threading.Thread(target=hold, args=(holding, release))
    thread.start()
    try:
        assert holding.wait(30)
        return _forked(_child_starts_with_the_switch_on_and_can_hold_it)
    finally:
        release.set()
        thread.join(30)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_a_fork_while_another_thread_holds_onednn_off_gives_the_child_the_users_switch():
    """Issue 56: the child inherited the count (1) and oneDNN off for its whole life."""

    def hold(holding: threading.Event, release: threading.Event) -> None:
        with onednn_off():
            holding.set()
            release.wait(30)

    assert _while_another_thread(hold) == "ok"
    assert _enabled() and holders() == 0  # the parent's holder let go as usual


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_a_fork_while_another_thread_holds_the_counts_lock_does_not_hang_the_child():
    def hold(holding: threading.Event, release: threading.Event) -> None:
        with onednn._lock:
            holding.set()
            release.wait(30)

    assert _while_another_thread(hold) == "ok"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_a_fork_from_inside_a_hold_lets_the_child_and_the_parent_let_go_once():
    hold = onednn_off()
    hold.__enter__()

    def child() -> bool:
        # The forking thread's own hold ends in the child too: it must not count below zero.
        fresh = _enabled() and holders() == 0
        hold.__exit__(None, None, None)
        return fresh and _enabled() and holders() == 0 and _child_starts_with_the_switch_on_and_can_hold_it()

    try:
        status = _forked(child)
        assert holders() == 1 and not _enabled()  # the parent's hold is its own
    finally:
        hold.__exit__(None, None, None)
    assert status == "ok" and _enabled() and holders() == 0
