package org.zerolock.core.device

import org.zerolock.core.protocol.ErrorCode
import org.zerolock.core.protocol.ProtocolException
import org.zerolock.core.protocol.Quote

/**
 * STAGE_ASSIGN field rules (PROTOCOL.md 5.3.1), checked before anything is read, created or
 * started: an authenticated host is still not trusted with the device's storage (run_id names a
 * file, never a path) or its threads (window_size sizes loops). The first bad field is refused
 * with REJECTED, the message starting `STAGE_ASSIGN <field>:`. The Python twin is
 * zl_mobile/assign_rules.py; tests/vectors/stage_assign/stage_assign_rules.json holds the cases.
 */
object StageAssignRules {
    private val RUN_ID = Regex("[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
    private val LABEL = "[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    private val HOSTNAME = Regex("$LABEL(\\.$LABEL)*")
    const val MAX_WINDOW = 4096L
    const val MAX_DEPTH = 4096L
    const val MAX_HORIZON = 1L shl 24
    private val SCHEDULES = listOf("zerolock", "gpipe", "1f1b", "pipedream")
    private val FAILURE_POINTS = listOf("after-phase1", "before-commit", "mid-checkpoint", "hold-gil-in-phase1", "slow-phase1")
    private val ANY_WINDOW_POINTS = listOf("slow-phase1") // window null: every window (a slower phone)
    private val FAILURE_MODES = listOf("process", "app") // the process dies / the stage fails inside the running app
    private val FAILURE_DETECTS = listOf("connection", "heartbeat") // app mode: the session drops / the stage goes silent

    private fun reject(field: String, why: String, rid: Long?): Nothing =
        throw ProtocolException(ErrorCode.REJECTED, "STAGE_ASSIGN $field: $why", rid)

    private fun isInt(v: Any?) = v is Long || v is Int
    private fun isNumber(v: Any?) = isInt(v) || (v is Double && v.isFinite()) || (v is Float && v.isFinite())
    /** A peer's value in a refusal: quoted, escaped and cut (tests/vectors/quoting.json). */
    private fun show(v: Any?): String = Quote.show(v)

    private fun intIn(m: Map<String, Any?>, key: String, lo: Long, hi: Long, rid: Long?, field: String = key,
                      nullable: Boolean = false) {
        if (!m.containsKey(key) || (nullable && m[key] == null)) return
        val v = m[key]
        if (!isInt(v) || (v as Number).toLong() !in lo..hi) reject(field, "${show(v)} must be an integer from $lo to $hi", rid)
    }

    private fun numberIn(c: Map<String, Any?>, key: String, ok: (Double) -> Boolean, what: String, rid: Long?) {
        if (!c.containsKey(key)) return
        val v = c[key]
        if (!isNumber(v) || !ok((v as Number).toDouble())) reject("config.$key", "${show(v)} must be $what", rid)
    }

    fun checkRunId(v: Any?, rid: Long? = null) {
        if (v !is String || !RUN_ID.matches(v)) reject("run_id", "${show(v)} must be a name of 1-128 letters, digits, '.', '_' or '-' " +
            "not starting with '.' or '-' (it names a file in the device's storage; no paths)", rid)
    }

    fun checkAddress(field: String, v: Any?, rid: Long? = null) {
        if (v !is String) reject(field, "${show(v)} must be a \"host:port\" string", rid)
        val colon = v.lastIndexOf(':')
        val port = if (colon < 0) "" else v.substring(colon + 1)
        if (colon < 0 || port.isEmpty() || !port.all { it in '0'..'9' } || port.length > 5 || port.toInt() !in 1..65535) {
            reject(field, "${show(v)} must be \"host:port\" with a port from 1 to 65535", rid)
        }
        val host = v.substring(0, colon)
        val ok = if (host.startsWith("[") && host.endsWith("]")) isIpv6(host.substring(1, host.length - 1))
                 else host.length in 1..253 && HOSTNAME.matches(host)
        if (!ok) reject(field, "${show(v)}: ${show(host)} is not an IPv4 address, [IPv6] address or host name", rid)
    }

    /** An IPv6 literal (RFC 4291 text forms, an IPv4 tail allowed), parsed here: no resolver is asked. */
    fun isIpv6(s: String): Boolean {
        var t = s
        val last = t.substringAfterLast(':')
        if ('.' in last) { // an IPv4 tail stands for two groups
            val q = last.split('.')
            if (q.size != 4 || q.any { p -> p.length !in 1..3 || !p.all { it in '0'..'9' } || p.toInt() > 255 }) return false
            t = t.dropLast(last.length) + "0:0"
        }
        fun groups(part: String): Int? {
            if (part.isEmpty()) return 0
            val g = part.split(':')
            return if (g.all { it.length in 1..4 && it.all { c -> c in '0'..'9' || c in 'a'..'f' || c in 'A'..'F' } }) g.size else null
        }
        val halves = t.split("::")
        return when (halves.size) {
            1 -> groups(t) == 8
            2 -> (groups(halves[0]) ?: return false) + (groups(halves[1]) ?: return false) <= 7
            else -> false
        }
    }

    @Suppress("UNCHECKED_CAST")
    fun validate(meta: Map<String, Any?>) {
        val rid = meta["request_id"] as? Long
        if (meta.containsKey("run_id")) checkRunId(meta["run_id"], rid)
        intIn(meta, "num_stages", 1, 1024, rid)
        if (meta["downstream"] != null) checkAddress("downstream", meta["downstream"], rid)
        val up = meta["upstream"]
        if (up is String && (up.length > 300 || up.any { it == '\u0000' || it == '\n' || it == '\r' })) {
            reject("upstream", "must be at most 300 characters on one line (a peer address or \"host\")", rid)
        }
        if (meta["downstream"] != null && !meta.containsKey("downstream_token")) {
            reject("downstream_token", "a stage with a downstream needs the pairing token of that link", rid)
        }
        intIn(meta, "window_size", 1, MAX_WINDOW, rid)
        intIn(meta, "inflight_depth", 1, MAX_DEPTH, rid)
        intIn(meta, "buffer_capacity", 1, MAX_DEPTH, rid)
        intIn(meta, "replay_horizon", 1, MAX_HORIZON, rid)
        intIn(meta, "listen_port", 0, 65535, rid)
        if (meta.containsKey("schedule") && meta["schedule"] !in SCHEDULES) {
            reject("schedule", "${show(meta["schedule"])} must be one of ${SCHEDULES.joinToString(", ")}", rid)
        }
        val c = meta["config"] as? Map<String, Any?> ?: return
        numberIn(c, "lr", { it >= 0 && it <= 100 }, "a number from 0 (forward-only) to 100", rid)
        numberIn(c, "weight_decay", { it in 0.0..100.0 }, "a number from 0 to 100", rid)
        if (c["alpha"] != null) numberIn(c, "alpha", { it in 0.0..1.0 }, "a number from 0 to 1 (or null: the export's)", rid)
        intIn(c, "keep_checkpoints", 1, 10_000, rid, "config.keep_checkpoints")
        intIn(c, "total_micro_batches", 1, 1L shl 53, rid, "config.total_micro_batches", nullable = true)
        intIn(c, "rollback_to_window", -1, 1L shl 53, rid, "config.rollback_to_window", nullable = true)
        intIn(c, "busy_ms", 0, 86_400_000, rid, "config.busy_ms")
        if (c.containsKey("restart") && c["restart"] !is Boolean) reject("config.restart", "${show(c["restart"])} must be true or false", rid)
        val inject = c["inject_failure"] ?: return
        if (inject !is List<*> || inject.size > 64) reject("config.inject_failure", "must be a list of at most 64 {window, point} objects", rid)
        for (sp in inject) {
            val o = sp as? Map<String, Any?>
            val w = o?.get("window")
            val anyWindow = o != null && w == null && o["point"] in ANY_WINDOW_POINTS
            val bad = o == null || !(anyWindow || (isInt(w) && (w as Number).toLong() >= 0)) || (o["point"] ?: "after-phase1") !in FAILURE_POINTS ||
                (o.containsKey("seconds") && (!isNumber(o["seconds"]) || (o["seconds"] as Number).toDouble() !in 0.0..3600.0)) ||
                (o["mode"] ?: "process") !in FAILURE_MODES || (o["detect"] ?: "connection") !in FAILURE_DETECTS
            if (bad) reject("config.inject_failure", "${show(sp)} must be {window: uint (null for slow-phase1), point: one of ${FAILURE_POINTS.joinToString(", ")}, seconds: 0..3600, " +
                "mode: ${FAILURE_MODES.joinToString(" or ")}, detect: ${FAILURE_DETECTS.joinToString(" or ")}}", rid)
        }
    }
}
