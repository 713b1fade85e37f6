package org.zerolock.core

import org.zerolock.core.protocol.Message
import org.zerolock.core.protocol.MsgType

/**
 * One telemetry report of a stage (the TELEMETRY message's metadata, PROTOCOL.md 5.5).
 *
 * Wire keys: the standard ones `stage`, `window`, `step`, `micro_batch`, `loss`, `pss_bytes`,
 * `temperature_c`, `active_s`, `wait_s`, `time_ms`, plus ZeroLock's `task_loss` and
 * `consis_loss` (the two terms of the local loss). The temperature is nullable here (a phone
 * may not report one) and then OMITTED on the wire, because a standard key that is present
 * must be a number; a received `null` is accepted as "unknown". `stage`, `step`, `pss_bytes`,
 * `active_s` and `wait_s` are required by this parser (a ZeroLock stage always sends them);
 * `window` may be absent (e.g. before the first window starts). Unknown keys are kept in
 * [extra] (decoders that hand metadata on must preserve them).
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
    val extra: Map<String, Any?> = emptyMap(),
) {
    fun toMap(): LinkedHashMap<String, Any?> {
        val m = LinkedHashMap<String, Any?>()
        for ((k, v) in extra) if (k !in KEYS) m[k] = v
        m["stage"] = stage.toLong()
        window?.let { m["window"] = it }
        m["step"] = step
        microBatch?.let { m["micro_batch"] = it }
        loss?.let { m["loss"] = it }
        taskLoss?.let { m["task_loss"] = it }
        consisLoss?.let { m["consis_loss"] = it }
        m["pss_bytes"] = pssBytes
        tempC?.let { m["temperature_c"] = it }
        m["active_s"] = activeS
        m["wait_s"] = waitS
        timeMs?.let { m["time_ms"] = it }
        return m
    }

    fun toJson(): String = Json.write(toMap())
    fun toMessage(): Message = Message(MsgType.TELEMETRY, toMap())

    companion object {
        val KEYS = setOf("stage", "window", "step", "micro_batch", "loss", "task_loss", "consis_loss", "pss_bytes",
            "temperature_c", "temp_c", "active_s", "wait_s", "time_ms")

        private fun Map<String, Any?>.uintOrNull(k: String): Long? {
            if (this[k] == null) return null
            val v = long(k)
            if (v < 0) throw Json.JsonError("'$k' must be >= 0")
            return v
        }

        fun fromMap(m: Map<String, Any?>): Telemetry {
            val stage = m.uintOrNull("stage") ?: throw Json.JsonError("'stage' is required")
            if (stage > Int.MAX_VALUE) throw Json.JsonError("'stage' out of range: $stage")
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
                extra = m.filterKeys { it !in KEYS },
            )
        }

        fun fromJson(text: String): Telemetry = fromMap(Json.parse(text).asObject("telemetry"))
        fun fromMessage(msg: Message): Telemetry = fromMap(msg.meta)
    }
}
