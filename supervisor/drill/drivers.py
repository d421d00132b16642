"""The drill's fault drivers: one small object per kind of fault that waits for its moment (an
event: a step, a save in flight, the trainer's marker), strikes, records the strike and waits for
the resume. The storage faults' drivers (storage.py) are drivers too."""

from __future__ import annotations

import signal
import time
from typing import TYPE_CHECKING, ClassVar

from supervisor.drill import inject, switch
from supervisor.drill.judge import StorageFacts
from supervisor.drill.plan import IN_SAVE, PREEMPT_NOTICE, SELF_INFLICTED, STORAGE, Fault, Kind

if TYPE_CHECKING:
    from supervisor.drill.runner import DrillConfig, Scene


class Driver:
    """Faults of ``kinds``: the job's extra flags, and ``drive``. The default drive waits for the
    fault's step (``reach``), strikes (``strike``), records the strike and waits for the resume."""

    kinds: ClassVar[frozenset[Kind]]

    def job_args(self, cfg: DrillConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Extra flags for the watchdog and for the trainer."""
        return (), ()

    def drive(self, scene: Scene, fault: Fault) -> StorageFacts | None:
        """Inject the fault into the running scene and wait until the run is past it (a storage
        driver returns what it saw). A fault that could not be injected is noted, not recorded."""
        launch = self.reach(scene, fault)
        if launch is None:
            return None
        in_flight, t0 = scene.save_in_flight(), time.time()
        if self.strike(scene, fault, launch):
            scene.struck(fault, t0, in_flight)
            scene.await_resume(fault, launch)
        return None

    def reach(self, scene: Scene, fault: Fault) -> str | None:
        """Wait for the moment to strike; the launch running then (None: it never came)."""
        return scene.reach(fault)

    def strike(self, scene: Scene, fault: Fault, launch: str) -> bool:
        """Inject the fault; False (noted) when it could not be."""
        raise NotImplementedError


class Kill(Driver):
    """kill -9 a rank (SIGSTOP for sigstop: a stop the watchdog's SIGCONT cures)."""

    kinds = frozenset({Kind.KILL9, Kind.SIGSTOP})

    def strike(self, scene: Scene, fault: Fault, launch: str) -> bool:
        return scene.kill(fault, launch, signal.SIGSTOP if fault.kind == Kind.SIGSTOP else signal.SIGKILL)


class MemoryKill(Kill):
    """kill -9 a rank right after a step that no disk checkpoint holds, the memory tier on (the
    watchdog's default): the reference trainer with a snapshot every step (a user's script keeps
    its own interval, ``Saves.memory_every``)."""

    kinds = frozenset({Kind.MEMORY})

    def job_args(self, cfg: DrillConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return (), (() if cfg.trainer else ("--memory-every", "1"))


class KillDuringSave(Kill):
    """kill -9 a rank while an async save of the fault's step or later is in flight (the runner
    widens the write with ENV_SAVE_DELAY so the kill lands inside it)."""

    kinds = frozenset({Kind.DURING_SAVE})

    def reach(self, scene: Scene, fault: Fault) -> str | None:
        launch = scene.reach(fault)
        if launch is not None and not scene.wait(
            lambda: inject.tmp_save_in_flight(scene.root, fault.at_step)
        ):
            scene.note(f"not injected: no async save of step >= {fault.at_step} was seen in flight")
            return None
        return launch


class Preempt(Driver):
    """A preemption as SLURM sends it (``fault.preempt_as``): SIGTERM to every process of the job
    (the watchdog stops, having let the ranks checkpoint; a new watchdog starts the job again, as
    a requeue does), or the notice (SIGUSR1) to every process (the watchdog relaunches)."""

    kinds = frozenset({Kind.PREEMPT})

    def strike(self, scene: Scene, fault: Fault, launch: str) -> bool:
        step = scene.step()
        if fault.preempt_as == PREEMPT_NOTICE:
            pids = scene.dog.signal_all(signal.SIGUSR1)
            scene.note(f"{fault.describe()}: at step {step}, {len(pids)} processes")
            return True
        pids = scene.dog.signal_all(signal.SIGTERM)
        scene.run.exit_codes.append(scene.dog.wait(timeout=scene.cfg.fault_timeout_s))
        scene.tail.poll()
        scene.note(
            f"{fault.describe()}: at step {step}, {len(pids)} processes; the job stopped at step "
            f"{scene.step()} (watchdog exit {scene.run.exit_codes[-1]}), started again"
        )
        scene.restart()
        return True


class CorruptLatest(Driver):
    """Stop the job (SIGTERM: it checkpoints), damage the newest checkpoint, start a new watchdog."""

    kinds = frozenset({Kind.CORRUPT_LATEST})

    def strike(self, scene: Scene, fault: Fault, launch: str) -> bool:
        assert fault.corruption is not None, "plan() gives every corrupt-latest fault its damage"
        scene.dog.signal(signal.SIGTERM)
        scene.run.exit_codes.append(scene.dog.wait(timeout=scene.cfg.fault_timeout_s))
        scene.tail.poll()
        did = inject.corrupt_newest(scene.root, fault.corruption)
        scene.note(f"{fault.describe()}: job stopped at step {scene.step()}; {did}")
        scene.restart()
        return True


class SelfInflictedHang(Driver):
    """A hang the trainer inflicts on itself at the fault's step (the drill switch): nothing to
    strike, only the trainer's marker to wait for, which says the launch it hung and when."""

    kinds = frozenset(SELF_INFLICTED)

    def drive(self, scene: Scene, fault: Fault) -> StorageFacts | None:
        assert scene.hangs is not None, "hang_switch() makes a switch for every self-inflicted hang"
        marker = scene.hangs.marker(switch_hang(fault))
        if not scene.wait(marker.exists) or (m := switch.read_marker(marker)) is None:
            scene.note(f"not injected: rank {fault.rank} never blocked at step {fault.at_step} ({marker})")
            return None
        in_flight = scene.save_in_flight()  # it stays so: nothing commits while the rank is stuck
        scene.note(
            f"{fault.describe()}: rank {fault.rank} (pid {m.get('pid')}) blocked at step {m.get('step')} "
            f"({'an async save in flight' if in_flight else 'no save in flight'})"
        )
        scene.struck(fault, float(m.get("t", time.time())), in_flight)
        scene.await_resume(fault, str(m.get("launch", "")))
        return None


def switch_hang(f: Fault) -> switch.Hang:
    how = {Kind.HANG_COLLECTIVE: switch.How.COLLECTIVE, Kind.HANG_LOADER: switch.How.LOADER}.get(
        f.kind, switch.How.READ
    )
    return switch.Hang(f.rank, f.at_step, switch.When.SAVE if f.kind in IN_SAVE else switch.When.STEP, how)


DRIVERS: dict[Kind, type[Driver]] = {
    k: d
    for d in (Kill, MemoryKill, KillDuringSave, Preempt, CorruptLatest, SelfInflictedHang)
    for k in d.kinds
}
assert set(DRIVERS) == set(Kind) - set(STORAGE), (
    "a driver for every fault kind (storage.py: the storage ones)"
)
