package org.zerolock.core

import java.io.ByteArrayOutputStream

/** DNS-SD TXT record handling (RFC 6763 section 6): length-prefixed "key=value" strings. */
object DnsSdTxt {
    class TxtError(message: String) : IllegalArgumentException(message)

    /** Encode entries in order. A null value encodes a boolean attribute ("key" without '='). */
    fun encode(entries: Map<String, String?>): ByteArray {
        val out = ByteArrayOutputStream()
        for ((k, v) in entries) {
            if (k.isEmpty()) throw TxtError("empty key")
            if (k.any { it == '=' || it.code < 0x20 || it.code > 0x7e }) throw TxtError("bad key '$k'")
            val bytes = (if (v == null) k else "$k=$v").toByteArray(Charsets.UTF_8)
            if (bytes.size > 255) throw TxtError("entry '$k' is ${bytes.size} bytes (max 255)")
            out.write(bytes.size)
            out.write(bytes)
        }
        if (out.size() == 0) out.write(0) // an empty TXT record is a single zero byte
        return out.toByteArray()
    }

    /**
     * Decode a TXT rdata blob. Keys compare case-insensitively (returned lower-case); the first
     * occurrence of a key wins; empty strings and strings starting with '=' are ignored; "key"
     * without '=' maps to null (present, no value).
     */
    /** As [decode], but values stay raw bytes (a value that is not UTF-8 is then reported, not replaced). */
    fun decodeRaw(data: ByteArray): LinkedHashMap<String, ByteArray?> {
        val m = LinkedHashMap<String, ByteArray?>()
        var i = 0
        while (i < data.size) {
            val len = data[i].toInt() and 0xff
            i++
            if (i + len > data.size) throw TxtError("truncated TXT entry at offset ${i - 1}")
            val entry = data.copyOfRange(i, i + len)
            i += len
            if (entry.isEmpty() || entry[0] == '='.code.toByte()) continue
            val eq = entry.indexOf('='.code.toByte())
            val key = String(if (eq < 0) entry else entry.copyOfRange(0, eq), Charsets.US_ASCII).lowercase()
            if (key !in m) m[key] = if (eq < 0) null else entry.copyOfRange(eq + 1, entry.size)
        }
        return m
    }

    fun decode(data: ByteArray): LinkedHashMap<String, String?> {
        val m = LinkedHashMap<String, String?>()
        var i = 0
        while (i < data.size) {
            val len = data[i].toInt() and 0xff
            i++
            if (i + len > data.size) throw TxtError("truncated TXT entry at offset ${i - 1}")
            val s = String(data, i, len, Charsets.UTF_8)
            i += len
            if (s.isEmpty() || s.startsWith("=")) continue
            val eq = s.indexOf('=')
            val key = (if (eq < 0) s else s.substring(0, eq)).lowercase()
            val value = if (eq < 0) null else s.substring(eq + 1)
            if (key !in m) m[key] = value
        }
        return m
    }
}

/**
 * The TXT record a ZeroLock device advertises with `_zerolock._tcp`:
 * name (device name), proto (wire protocol version), runtime (e.g. "executorch-1.5.1"),
 * mem (bytes of memory available to the app, decimal).
 */
data class ZeroLockTxt(
    val name: String,
    val proto: Int,
    val runtime: String,
    val memBytes: Long,
    val extra: Map<String, String?> = emptyMap(),
) {
    init {
        require(proto >= 0) { "proto must be >= 0" }
        require(memBytes >= 0) { "mem must be >= 0" }
    }

    /** Attribute map in advertising order (what NsdServiceInfo.setAttribute receives). */
    fun toAttributes(): LinkedHashMap<String, String?> {
        val m = LinkedHashMap<String, String?>()
        m["name"] = name
        m["proto"] = proto.toString()
        m["runtime"] = runtime
        m["mem"] = memBytes.toString()
        for ((k, v) in extra) if (k.lowercase() !in KEYS) m[k] = v
        return m
    }

    fun encode(): ByteArray = DnsSdTxt.encode(toAttributes())

    companion object {
        val KEYS = setOf("name", "proto", "runtime", "mem")

        /** A record of this protocol version, checked as docs/PROTOCOL.md 10.3 says; TxtError names what is wrong. */
        fun fromAttributes(attrs: Map<String, String?>): ZeroLockTxt {
            val c = checkText(attrs)
            if (c.status != TxtCheck.OK) throw DnsSdTxt.TxtError("${c.status} TXT record: ${c.reason}")
            val a = LinkedHashMap<String, String?>()
            for ((k, v) in attrs) a.putIfAbsent(k.lowercase(), v)
            return ZeroLockTxt(c.name!!, c.proto!!, c.runtime!!, c.memBytes!!, a.filterKeys { it !in KEYS })
        }

        /** Check the attributes NsdServiceInfo.getAttributes() gives (raw values; null: a key without '='). Never throws. */
        fun check(attrs: Map<String, ByteArray?>): TxtCheck = ZeroLockService.checkTxt(attrs.mapValues { (_, v) -> v?.let { TxtValue.Raw(it) } })

        /** Check a TXT record's rdata as it came off the wire; TxtError only if its framing is broken. */
        fun checkRecord(data: ByteArray): TxtCheck = check(DnsSdTxt.decodeRaw(data))

        fun checkText(attrs: Map<String, String?>): TxtCheck = ZeroLockService.checkTxt(attrs.mapValues { (_, v) -> v?.let { TxtValue.Text(it) } })

        fun decode(data: ByteArray): ZeroLockTxt = fromAttributes(DnsSdTxt.decode(data))
    }
}

/** A TXT value as it arrived: text, or raw bytes still to be decoded as UTF-8. */
sealed class TxtValue {
    data class Text(val s: String) : TxtValue()
    class Raw(val bytes: ByteArray) : TxtValue()
}

/** A TXT record checked against docs/PROTOCOL.md 10.3: status OK, INVALID or INCOMPATIBLE (another proto). */
data class TxtCheck(
    val status: String,
    val name: String? = null,
    val proto: Int? = null,
    val runtime: String? = null,
    val memBytes: Long? = null,
    val cpuShare: Double? = null,
    val problems: Map<String, String> = emptyMap(),
) {
    val reason: String get() = problems.entries.joinToString("; ") { "${it.key} ${it.value}" }

    companion object {
        const val OK = "ok"
        const val INVALID = "invalid"
        const val INCOMPATIBLE = "incompatible"
    }
}

/** The `_zerolock._tcp` service (docs/PROTOCOL.md section 10): instance names and TXT keys. */
object ZeroLockService {
    const val TYPE = "_zerolock._tcp"
    const val TYPE_FQDN = "_zerolock._tcp.local."
    const val PROTO = org.zerolock.core.protocol.Frames.PROTOCOL_VERSION  // 2: sealed sessions
    const val MAX_INSTANCE_BYTES = 63
    const val CPU_SHARE_MAX = 1024.0
    val REQUIRED = listOf("name", "proto", "runtime", "mem")
    private val DIGITS = Regex("[0-9]{1,19}")
    private val DECIMAL = Regex("[0-9]{1,6}(\\.[0-9]{1,9})?")

    private fun controlChar(s: String): Char? = s.firstOrNull { it.code < 0x20 || it.code == 0x7f }

    /** Why `name` cannot be an instance name (one DNS label of UTF-8), or null if it can. */
    fun instanceNameProblem(name: String): String? {
        if (name.isEmpty()) return "is empty"
        val enc = Charsets.UTF_8.newEncoder()
        val bytes = try { enc.encode(java.nio.CharBuffer.wrap(name)).remaining() } catch (e: java.nio.charset.CharacterCodingException) {
            return "is not valid UTF-16 (a lone surrogate)"
        }
        if (bytes > MAX_INSTANCE_BYTES) return "is $bytes bytes in UTF-8; an mDNS instance name is at most $MAX_INSTANCE_BYTES"
        controlChar(name)?.let { return "contains the control character U+%04X".format(it.code) }
        return null
    }

    /** [instanceNameProblem] as one line naming the name ("device name 'NAME' is empty"), its
     *  control characters written as \uXXXX so the line stays one line; null if the name is fine. */
    fun instanceNameRefusal(name: String): String? = instanceNameProblem(name)?.let { problem ->
        val shown = buildString { for (c in name) if (c.code < 0x20 || c.code == 0x7f) append("\\u%04x".format(c.code)) else append(c) }
        "device name '$shown' $problem"
    }

    /** RFC 6763 4.3 presentation form: '.' -> "\\.", '\\' -> "\\\\". */
    fun escapeInstance(label: String): String = label.replace("\\", "\\\\").replace(".", "\\.")

    fun checkTxt(props: Map<String, TxtValue?>): TxtCheck {
        val attrs = LinkedHashMap<String, TxtValue?>()
        for ((k, v) in props) if (!attrs.containsKey(k.lowercase())) attrs[k.lowercase()] = v
        val problems = LinkedHashMap<String, String>()

        fun value(key: String): String? {
            if (!attrs.containsKey(key)) {
                if (key in REQUIRED) problems[key] = "is missing"
                return null
            }
            val v = when (val raw = attrs[key]) {
                null -> { problems[key] = "has no value (write key=value)"; return null }
                is TxtValue.Text -> raw.s
                is TxtValue.Raw -> try {
                    Charsets.UTF_8.newDecoder().decode(java.nio.ByteBuffer.wrap(raw.bytes)).toString()
                } catch (e: java.nio.charset.CharacterCodingException) {
                    problems[key] = "is not UTF-8"; return null
                }
            }
            if (controlChar(v) != null) { problems[key] = "'$v' contains a control character"; return null }
            return v
        }

        var proto: Int? = null
        value("proto")?.let { p ->
            if (DIGITS.matches(p) && p.length <= 9) proto = p.toInt() else problems["proto"] = "'$p' is not a protocol version (a whole number)"
        }
        var name: String? = null
        value("name")?.let { n -> instanceNameProblem(n)?.let { problems["name"] = "'$n' $it" } ?: run { name = n } }
        if (proto != null && proto != PROTO) {
            return TxtCheck(TxtCheck.INCOMPATIBLE, name = name, proto = proto,
                problems = mapOf("proto" to "$proto is not this side's protocol version $PROTO"))
        }
        var runtime: String? = null
        value("runtime")?.let { r ->
            if (r.isEmpty() || r.toByteArray(Charsets.UTF_8).size > 200) problems["runtime"] = "'$r' must be 1-200 bytes" else runtime = r
        }
        var mem: Long? = null
        value("mem")?.let { m ->
            val x = if (DIGITS.matches(m)) m.toBigInteger() else null
            if (x != null && x < java.math.BigInteger.ONE.shiftLeft(63)) mem = x.toLong() else problems["mem"] = "'$m' is not a whole number of bytes"
        }
        var share: Double? = null
        if (attrs.containsKey("cpu_share")) value("cpu_share")?.let { c ->
            val x = if (DECIMAL.matches(c)) c.toDouble() else Double.NaN
            if (x > 0 && x <= CPU_SHARE_MAX) share = x else problems["cpu_share"] = "'$c' is not a decimal number of cores in (0, 1024]"
        }
        return TxtCheck(if (problems.isEmpty()) TxtCheck.OK else TxtCheck.INVALID, name, proto, runtime, mem, share, problems)
    }
}
