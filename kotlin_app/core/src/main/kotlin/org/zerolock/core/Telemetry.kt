package org.zerolock.core

import org.zerolock.core.protocol.Message
import org.zerolock.core.protocol.MsgType
import java.io.File
import java.io.IOException

/**
 * One telemetry report of a stage (the TELEMETRY message's metadata, PROTOCOL.md 5.5).
 *
 * [kind] is `micro_batch` (sent after each micro-batch's phase 2; running totals) or `window`
 * (sent once per update window, right after its checkpoint and before CHECKPOINT_COMMITTED; the
 * window's figures, see [WindowTelemetry]). It is always written; a received record without it
 * is a `micro_batch` record.
 *
 * Wire keys: the standard ones `kind`, `stage`, `window`, `step`, `micro_batch`, `loss`,
 * `pss_bytes`, `rss_peak_bytes`, `temperature_c`, `active_s`, `wait_s`, `bytes_in`, `bytes_out`,
 * `time_ms`, ZeroLock's `task_loss` and `consis_loss` (the two terms of the local loss), and the
 * window record's `micro_batches`, `phase1_s`, `phase2_s`, `step_s`, `seconds`. A reading the
 * device cannot make (temperature, peak RSS...) is null here and then OMITTED on the wire, never
 * invented; a received `null` is accepted as "unknown". `stage`, `step`, `pss_bytes`, `active_s`
 * and `wait_s` are required by this parser (a ZeroLock stage always sends them); `window` may be
 * absent (e.g. before the first window starts). Unknown keys are kept in [extra] (decoders that
 * hand metadata on must preserve them).
 */
data class Telemetry(
    val stage: Int,
    val window: Long?,
    val step: Long,
    val taskLoss: Double?,
    val consisLoss: Double?,
    val pssBytes: Long,
    val tempC: Double?,
    val activeS: Double,
    val waitS: Double,
    val loss: Double? = null,
    val microBatch: Long? = null,
    val timeMs: Long? = null,
    val kind: String = MICRO_BATCH,
    val rssPeakBytes: Long? = null,
    val bytesIn: Long? = null,
    val bytesOut: Long? = null,
    /** Window records: how many micro-batches the window's means are over. */
    val microBatches: Long? = null,
    /** Window records: seconds in phase 1, in phase 2 (summed over the micro-batches), in the step + checkpoint. */
    val phase1S: Double? = null,
    val phase2S: Double? = null,
    val stepS: Double? = null,
    /** Window records: wall-clock seconds of the window (since the previous window record). */
    val seconds: Double? = null,
    val extra: Map<String, Any?> = emptyMap(),
) {
    val isWindow: Boolean get() = kind == WINDOW

    fun toMap(): LinkedHashMap<String, Any?> {
        val m = LinkedHashMap<String, Any?>()
        m["kind"] = kind
        for ((k, v) in extra) if (k !in KEYS) m[k] = v
        m["stage"] = stage.toLong()
        window?.let { m["window"] = it }
        m["step"] = step
        microBatch?.let { m["micro_batch"] = it }
        microBatches?.let { m["micro_batches"] = it }
        loss?.let { m["loss"] = it }
        taskLoss?.let { m["task_loss"] = it }
        consisLoss?.let { m["consis_loss"] = it }
        phase1S?.let { m["phase1_s"] = it }
        phase2S?.let { m["phase2_s"] = it }
        stepS?.let { m["step_s"] = it }
        m["active_s"] = activeS
        m["wait_s"] = waitS
        seconds?.let { m["seconds"] = it }
        bytesIn?.let { m["bytes_in"] = it }
        bytesOut?.let { m["bytes_out"] = it }
        m["pss_bytes"] = pssBytes
        rssPeakBytes?.let { m["rss_peak_bytes"] = it }
        tempC?.let { m["temperature_c"] = it }
        timeMs?.let { m["time_ms"] = it }
        // a NaN or infinite reading (a diverging run's loss) has no JSON form: left out and named
        // in `nonfinite` (PROTOCOL.md 5.5), so the record still goes and the host sees the divergence
        // (zl_mobile.stage_core.present; tests/vectors/stage_core/stage_core.json `present`, run by both)
        val bad = m.entries.filter { (_, v) -> (v is Double && !v.isFinite()) || (v is Float && !v.isFinite()) }.map { it.key }.sorted()
        if (bad.isNotEmpty()) {
            bad.forEach { m.remove(it) }
            m["nonfinite"] = bad
        }
        return m
    }

    fun toJson(): String = Json.write(toMap())
    fun toMessage(): Message = Message(MsgType.TELEMETRY, toMap())

    companion object {
        const val MICRO_BATCH = "micro_batch"
        const val WINDOW = "window"

        val KEYS = setOf("kind", "stage", "window", "step", "micro_batch", "loss", "task_loss", "consis_loss", "pss_bytes",
            "rss_peak_bytes", "temperature_c", "temp_c", "active_s", "wait_s", "bytes_in", "bytes_out", "time_ms",
            "micro_batches", "phase1_s", "phase2_s", "step_s", "seconds")

        private fun Map<String, Any?>.uintOrNull(k: String): Long? {
            if (this[k] == null) return null
            val v = long(k)
            if (v < 0) throw Json.JsonError("'$k' must be >= 0")
            return v
        }

        fun fromMap(m: Map<String, Any?>): Telemetry {
            val stage = m.uintOrNull("stage") ?: throw Json.JsonError("'stage' is required")
            if (stage > Int.MAX_VALUE) throw Json.JsonError("'stage' out of range: $stage")
            val kind = when (val k = m["kind"]) { null -> MICRO_BATCH; is String -> k; else -> throw Json.JsonError("'kind' must be a string, got $k") }
            return Telemetry(
                stage = stage.toInt(),
                window = m.uintOrNull("window"),
                step = m.uintOrNull("step") ?: throw Json.JsonError("'step' is required"),
                taskLoss = m.numOrNull("task_loss")?.toDouble(),
                consisLoss = m.numOrNull("consis_loss")?.toDouble(),
                pssBytes = m.uintOrNull("pss_bytes") ?: throw Json.JsonError("'pss_bytes' is required"),
                tempC = (m.numOrNull("temperature_c") ?: m.numOrNull("temp_c"))?.toDouble(),
                activeS = m.num("active_s").toDouble(),
                waitS = m.num("wait_s").toDouble(),
                loss = m.numOrNull("loss")?.toDouble(),
                microBatch = m.uintOrNull("micro_batch"),
                timeMs = m.uintOrNull("time_ms"),
                kind = kind,
                rssPeakBytes = m.uintOrNull("rss_peak_bytes"),
                bytesIn = m.uintOrNull("bytes_in"),
                bytesOut = m.uintOrNull("bytes_out"),
                microBatches = m.uintOrNull("micro_batches"),
                phase1S = m.numOrNull("phase1_s")?.toDouble(),
                phase2S = m.numOrNull("phase2_s")?.toDouble(),
                stepS = m.numOrNull("step_s")?.toDouble(),
                seconds = m.numOrNull("seconds")?.toDouble(),
                extra = m.filterKeys { it !in KEYS },
            )
        }

        fun fromJson(text: String): Telemetry = fromMap(Json.parse(text).asObject("telemetry"))
        fun fromMessage(msg: Message): Telemetry = fromMap(msg.meta)
    }
}

/** The running counters a stage keeps; a window record reports their change over the window. */
data class TelemetryCounters(val activeS: Double, val waitS: Double, val seconds: Double, val bytesIn: Long, val bytesOut: Long)

/**
 * Sums a stage's micro-batches per update window and makes the window's TELEMETRY record
 * (`kind` = `window`), as zl_mobile/stage_core.py does (StageCore.add, `_window_record`; the shared
 * figures: tests/vectors/stage_core/stage_core.json `window_records`, run by both):
 * mean `loss` / `task_loss` / `consis_loss` over the window's `micro_batches` (a loss no
 * micro-batch reported is left out), `phase1_s` and `phase2_s` summed over them, the step's
 * `step_s`, and `active_s`, `wait_s`, `seconds` (wall), `bytes_in`, `bytes_out` as deltas since
 * the previous window record (since [start] for the first); `rss_peak_bytes` is the highest of the
 * micro-batches' peaks and the reading taken when the window closes, left out if none was made;
 * `memory` adds the breakdown's readings (`pss_runtime_bytes`, `pss_weights_bytes`) that were made.
 * Not thread-safe: the stage's worker thread alone uses it.
 */
class WindowTelemetry(private val stage: Int, private val schedule: String, start: TelemetryCounters,
                      private val forwardOnly: Boolean = false) {
    private class Sums {
        var microBatches = 0L
        var phase1S = 0.0
        var phase2S = 0.0
        var phase2Calls = 0L
        val losses = LinkedHashMap<String, Double>()
        var rssPeak: Long? = null
    }

    private val open = HashMap<Long, Sums>()
    private var mark = start

    /** One trained micro-batch of [window] (its micro_batch record's figures). */
    fun add(window: Long, phase1S: Double, phase2S: Double, loss: Double?, taskLoss: Double?, consisLoss: Double?, rssPeakBytes: Long?,
            phase2: Boolean = true) {
        val s = open.getOrPut(window) { Sums() }
        s.microBatches += 1
        if (phase2) s.phase2Calls += 1
        s.phase1S += phase1S
        s.phase2S += phase2S
        for ((k, v) in listOf("loss" to loss, "task_loss" to taskLoss, "consis_loss" to consisLoss)) {
            if (v != null) s.losses[k] = (s.losses[k] ?: 0.0) + v
        }
        s.rssPeak = maxOfNullable(s.rssPeak, rssPeakBytes)
    }

    /**
     * The record of [window], just committed as optimizer step [step] in [stepS] seconds; [now]
     * are the counters at this moment. Null (and the mark kept) if no micro-batch of [window] was
     * added, as in zl_mobile.
     */
    fun close(window: Long, step: Long, stepS: Double, now: TelemetryCounters, pssBytes: Long, tempC: Double?, rssPeakNow: Long?,
              memory: Map<String, Long> = emptyMap()): Telemetry? {
        val s = open.remove(window) ?: return null
        val then = mark
        mark = now
        val n = s.microBatches.toDouble()
        return Telemetry(
            kind = Telemetry.WINDOW, stage = stage, window = window, step = step,
            microBatches = s.microBatches,
            loss = s.losses["loss"]?.div(n), taskLoss = s.losses["task_loss"]?.div(n), consisLoss = s.losses["consis_loss"]?.div(n),
            phase1S = s.phase1S, phase2S = s.phase2S, stepS = stepS,
            activeS = now.activeS - then.activeS, waitS = now.waitS - then.waitS, seconds = now.seconds - then.seconds,
            bytesIn = now.bytesIn - then.bytesIn, bytesOut = now.bytesOut - then.bytesOut,
            pssBytes = pssBytes, rssPeakBytes = maxOfNullable(s.rssPeak, rssPeakNow), tempC = tempC,
            extra = LinkedHashMap<String, Any?>().apply {
                put("schedule", schedule); put("phase2_calls", s.phase2Calls)
                if (forwardOnly) put("forward_only", true) // as zl_mobile: absent on a training stage
                putAll(memory)
            },
        )
    }

    private fun maxOfNullable(a: Long?, b: Long?): Long? = if (a == null) b else if (b == null) a else maxOf(a, b)
}

/**
 * Readings from Linux procfs (Android's too) for this process, the Kotlin twin of
 * zl_mobile/telemetry.py: PSS from `smaps_rollup`, and the peak RSS from the kernel's VmHWM mark
 * in `status`, which [takePeakRssBytes] then resets by writing "5" to `clear_refs` (Linux >= 4.0).
 * The kernel tracks that peak exactly, also inside native calls no sampling thread would see.
 * Each reading is null where the file is missing or unreadable (not Linux, a sandbox that hides
 * it): a value is never invented. [dir] is `/proc/self`; tests pass a directory of their own.
 */
class ProcStats(private val dir: File = File("/proc/self")) {
    /** Proportional set size in bytes, or null. */
    fun pssBytes(): Long? = kibLine("smaps_rollup", "Pss:")

    private val runtimePss: Long? by lazy { pssBytes() }

    /**
     * The PSS at the first call, and the same value ever after: called before the first program is
     * loaded, what the runtime itself costs (the memory breakdown's `pss_runtime_bytes`), or null.
     */
    fun runtimePssBytes(): Long? = runtimePss

    /**
     * PSS of the mapped weights files (`.ptd`), from `smaps` (as zl_mobile's read_pss_by_backing);
     * null where `smaps` cannot be read, 0 where no weights file is mapped (a runtime that reads
     * the weights into its heap instead).
     */
    fun pssWeightsBytes(): Long? = readOrNull("smaps") { lines ->
        var total = 0L
        var weights = false
        for (line in lines) {
            val head = line.trim().split(Regex("\\s+"), limit = 6)
            if (head[0].isEmpty()) continue
            if (!head[0].endsWith(":")) { // a mapping's header: range perms offset dev inode [path]
                weights = head.size > 5 && head[5].removeSuffix(" (deleted)").trimEnd().endsWith(".ptd")
            } else if (head[0] == "Pss:" && weights && head.size > 1) {
                total += head[1].toLong() * 1024
            }
        }
        total
    }

    /**
     * Peak RSS in bytes since the previous call (since the process started, the first time), then
     * the mark is reset to the current RSS; null where unavailable. If the reset is refused the
     * peak is still returned (as zl_mobile does), so it then counts from an earlier point.
     */
    fun takePeakRssBytes(): Long? {
        val peak = kibLine("status", "VmHWM:") ?: return null
        try {
            File(dir, "clear_refs").writeText("5")
        } catch (_: IOException) {
        } catch (_: SecurityException) {
        }
        return peak
    }

    private fun kibLine(file: String, prefix: String): Long? = readOrNull(file) { lines ->
        lines.firstOrNull { it.startsWith(prefix) }?.substring(prefix.length)?.trim()?.split(Regex("\\s+"))?.firstOrNull()?.toLong()?.times(1024)
    }

    /** [parse] over the lines of [file] in [dir]; null where it cannot be read or holds no number. */
    private fun <T> readOrNull(file: String, parse: (Sequence<String>) -> T?): T? = try {
        File(dir, file).useLines(block = parse)
    } catch (_: IOException) {
        null
    } catch (_: NumberFormatException) {
        null
    } catch (_: SecurityException) {
        null
    }

    companion object {
        /** This process. */
        val SELF = ProcStats()
    }
}
