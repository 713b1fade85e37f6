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

        fun fromAttributes(attrs: Map<String, String?>): ZeroLockTxt {
            val a = attrs.mapKeys { it.key.lowercase() }
            fun req(k: String): String = a[k] ?: throw DnsSdTxt.TxtError("TXT record lacks '$k'")
            val proto = req("proto").toIntOrNull()?.takeIf { it >= 0 } ?: throw DnsSdTxt.TxtError("bad proto '${a["proto"]}'")
            val mem = req("mem").toLongOrNull()?.takeIf { it >= 0 } ?: throw DnsSdTxt.TxtError("bad mem '${a["mem"]}'")
            return ZeroLockTxt(req("name"), proto, req("runtime"), mem, a.filterKeys { it !in KEYS })
        }

        fun decode(data: ByteArray): ZeroLockTxt = fromAttributes(DnsSdTxt.decode(data))
    }
}
