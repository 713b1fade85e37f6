package org.zerolock.core.device

import java.io.File

/** One STAGE_ASSIGN `config.inject_failure` entry (PROTOCOL.md 5.3.1), read as zl_mobile/stage_core.py reads it
 *  (tests/vectors/stage_core/stage_core.json `fault_specs`, run by both). */
data class FailureSpec(
    /** null: every window (slow-phase1 only; StageAssignRules refuses it elsewhere). */
    val window: Long?,
    val point: String,
    val seconds: Double,
    /** "process": the phone process dies; "app": the stage drops its state inside the running phone. */
    val mode: String,
    /** App mode: "connection" (the host session is closed) or "heartbeat" (the device goes silent). */
    val detect: String,
) {
    companion object {
        fun of(m: Map<*, *>): FailureSpec = FailureSpec(
            window = (m["window"] as? Number)?.toLong(),
            point = m["point"] as? String ?: FaultInjector.AFTER_PHASE1,
            seconds = (m["seconds"] as? Number)?.toDouble() ?: 0.0,
            mode = m["mode"] as? String ?: "process",
            detect = m["detect"] as? String ?: "connection",
        )

        fun listOf(v: Any?): List<FailureSpec> = (v as? List<*>)?.mapNotNull { (it as? Map<*, *>)?.let(::of) } ?: emptyList()
    }
}

/** Fault injection, mode "app": the stage fails inside the running app (see [StageRuntime]). */
class AppFailure(val detect: String) : RuntimeException("injected in-app failure (detected by $detect)")

/**
 * The Kotlin twin of zl_mobile/stage_core.py's fault injection (Faults; tests, benchmarks), same points, same
 * once-only rule (tests/vectors/stage_core/stage_core.json `fault_firing`, run by both): a failure fires once per run, stage, window and point, remembered by a marker
 * file in the device's storage (`failure-injected-RUN-K-W-POINT`), so the restarted or re-assigned
 * stage replays that window without failing again.
 *
 * - after-phase1 (h_k published and on disk), before-commit (after the window's AdamW step, before
 *   its checkpoint is written), mid-checkpoint (the checkpoint's temporary file written, then cut
 *   in half as a crash mid-write leaves it): mode "process" halts the JVM at once (exit code
 *   [FAILURE_EXIT_CODE], no shutdown hooks, as zl-phone's os._exit), mode "app" throws [AppFailure].
 * - slow-phase1: every phase 1 of `window` (null: of every window) sleeps `seconds` more.
 * - hold-gil-in-phase1: the Python phone holds its interpreter lock for `seconds`, so its
 *   heartbeat thread stops. A JVM has no such lock; the nearest equivalent: the stage announces
 *   HEARTBEAT busy_ms, then phase 1 stalls `seconds` with the device's heartbeats paused for as
 *   long (once per window and stage, as zl_mobile).
 */
class FaultInjector(
    private val specs: List<FailureSpec>,
    private val markerDir: File,
    private val runId: String,
    private val stage: Int,
    private val log: (String) -> Unit,
) {
    companion object {
        const val AFTER_PHASE1 = "after-phase1"
        const val BEFORE_COMMIT = "before-commit"
        const val MID_CHECKPOINT = "mid-checkpoint"
        const val STALL = "hold-gil-in-phase1"
        const val SLOW = "slow-phase1"
        /** zl_mobile.stage.FAILURE_EXIT_CODE: the host sees an exit of its own, not a signal. */
        const val FAILURE_EXIT_CODE = 86
    }

    private val stalled = HashSet<Long>()

    /** Seconds every phase 1 of [window] sleeps more (slow-phase1: a slower phone). */
    fun slowSeconds(window: Long): Double =
        specs.filter { it.point == SLOW && (it.window == null || it.window == window) }.sumOf { it.seconds }

    /** hold-gil-in-phase1 of [window]: its seconds the first time that window's phase 1 runs here, else null. */
    fun stallSeconds(window: Long): Double? =
        specs.firstOrNull { it.point == STALL && it.window == window }?.takeIf { stalled.add(window) }?.seconds

    /**
     * Fail at [point] of [window] if a spec names them and it has not fired yet. [tear] cuts the
     * checkpoint being written (mid-checkpoint). Returns normally when nothing fires.
     */
    fun maybeFail(point: String, window: Long, tear: () -> String? = { null }) {
        val spec = specs.firstOrNull { it.point == point && it.window == window } ?: return
        val marker = File(markerDir, "failure-injected-$runId-$stage-$window-$point")
        if (marker.exists()) return
        markerDir.mkdirs()
        marker.writeText("injected")
        log("stage $stage: injected failure (${spec.mode}) at $point of window $window")
        if (point == MID_CHECKPOINT) tear()?.let { log("stage $stage: $it") }
        if (spec.mode == "app") throw AppFailure(spec.detect)
        System.err.flush()
        Runtime.getRuntime().halt(FAILURE_EXIT_CODE) // like kill -9: no shutdown hook, no finally, nothing flushed
    }
}
