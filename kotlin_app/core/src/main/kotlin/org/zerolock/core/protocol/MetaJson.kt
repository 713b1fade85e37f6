package org.zerolock.core.protocol

import java.math.BigInteger
import java.nio.ByteBuffer
import java.nio.charset.CharacterCodingException
import java.nio.charset.CodingErrorAction

/**
 * Strict JSON for frame metadata (PROTOCOL.md 3.1): UTF-8 without BOM, RFC 8259 grammar, no
 * duplicate keys, no NaN/Infinity, integers fit int64, floats finite, no lone surrogates,
 * depth <= 32. Every violation is [ErrorCode.MALFORMED].
 *
 * Values: null, Boolean, Long (integer tokens), Double (tokens with fraction or exponent),
 * String, List<Any?>, LinkedHashMap<String, Any?>.
 */
object MetaJson {
    const val MAX_DEPTH = 32

    fun parseObject(bytes: ByteArray, off: Int = 0, len: Int = bytes.size): LinkedHashMap<String, Any?> {
        val text = try {
            Charsets.UTF_8.newDecoder()
                .onMalformedInput(CodingErrorAction.REPORT)
                .onUnmappableCharacter(CodingErrorAction.REPORT)
                .decode(ByteBuffer.wrap(bytes, off, len)).toString()
        } catch (e: CharacterCodingException) {
            malformed("metadata is not valid UTF-8")
        }
        if (text.startsWith("\uFEFF")) malformed("metadata starts with a byte order mark")
        val p = P(text)
        p.ws()
        if (p.i >= text.length || text[p.i] != '{') malformed("metadata must be a JSON object")
        @Suppress("UNCHECKED_CAST")
        val v = p.value(1) as LinkedHashMap<String, Any?>
        p.ws()
        if (p.i != text.length) malformed("metadata has trailing characters after the JSON object")
        return v
    }

    /** Compact JSON with sorted keys, non-ASCII kept (the form PROTOCOL.md 3.1 recommends). */
    fun encode(meta: Map<String, Any?>): ByteArray {
        val sb = StringBuilder()
        write(sb, meta, 1)
        return sb.toString().toByteArray(Charsets.UTF_8)
    }

    private fun write(sb: StringBuilder, v: Any?, depth: Int) {
        when (v) {
            null -> sb.append("null")
            is Boolean -> sb.append(v)
            is Long, is Int, is Short, is Byte -> sb.append(v.toString())
            is Double, is Float -> {
                val d = (v as Number).toDouble()
                require(!d.isNaN() && !d.isInfinite()) { "NaN/Infinity cannot be sent in metadata" }
                sb.append(d.toString()) // always has '.' or 'E': stays a float on the other side
            }
            is String -> writeString(sb, v)
            is Map<*, *> -> {
                require(depth <= MAX_DEPTH) { "metadata nested deeper than $MAX_DEPTH" }
                sb.append('{')
                val keys = v.keys.map { it as? String ?: throw IllegalArgumentException("metadata keys must be strings") }.sorted()
                keys.forEachIndexed { idx, k ->
                    if (idx > 0) sb.append(',')
                    writeString(sb, k); sb.append(':'); write(sb, v[k], depth + 1)
                }
                sb.append('}')
            }
            is Iterable<*> -> {
                require(depth <= MAX_DEPTH) { "metadata nested deeper than $MAX_DEPTH" }
                sb.append('[')
                v.forEachIndexed { idx, x -> if (idx > 0) sb.append(','); write(sb, x, depth + 1) }
                sb.append(']')
            }
            else -> throw IllegalArgumentException("cannot encode ${v::class.java.name} in metadata")
        }
    }

    private fun writeString(sb: StringBuilder, s: String) {
        sb.append('"')
        var i = 0
        while (i < s.length) {
            val c = s[i]
            when {
                c == '"' -> sb.append("\\\"")
                c == '\\' -> sb.append("\\\\")
                c == '\n' -> sb.append("\\n")
                c == '\r' -> sb.append("\\r")
                c == '\t' -> sb.append("\\t")
                c < ' ' -> sb.append(String.format("\\u%04x", c.code))
                Character.isHighSurrogate(c) -> {
                    require(i + 1 < s.length && Character.isLowSurrogate(s[i + 1])) { "unpaired surrogate in string" }
                    sb.append(c).append(s[i + 1]); i++
                }
                Character.isLowSurrogate(c) -> throw IllegalArgumentException("unpaired surrogate in string")
                else -> sb.append(c)
            }
            i++
        }
        sb.append('"')
    }

    private class P(val s: String) {
        var i = 0

        fun ws() { while (i < s.length && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) i++ }

        fun value(depth: Int): Any? {
            if (i >= s.length) malformed("metadata JSON ends early")
            return when (val c = s[i]) {
                '{' -> obj(depth)
                '[' -> arr(depth)
                '"' -> str()
                't' -> lit("true", true)
                'f' -> lit("false", false)
                'n' -> lit("null", null)
                else -> if (c == '-' || c in '0'..'9') num() else malformed("metadata JSON: unexpected character '$c' at $i")
            }
        }

        fun lit(w: String, v: Any?): Any? {
            if (!s.startsWith(w, i)) malformed("metadata JSON: bad literal at $i")
            i += w.length
            return v
        }

        fun obj(depth: Int): LinkedHashMap<String, Any?> {
            if (depth > MAX_DEPTH) malformed("metadata JSON nested deeper than $MAX_DEPTH")
            val m = LinkedHashMap<String, Any?>()
            i++
            ws()
            if (i < s.length && s[i] == '}') { i++; return m }
            while (true) {
                ws()
                if (i >= s.length || s[i] != '"') malformed("metadata JSON: expected a key at $i")
                val k = str()
                ws()
                if (i >= s.length || s[i] != ':') malformed("metadata JSON: expected ':' at $i")
                i++
                ws()
                if (m.containsKey(k)) malformed("metadata JSON: duplicate key '$k'")
                m[k] = value(depth + 1)
                ws()
                if (i >= s.length) malformed("metadata JSON: unterminated object")
                when (s[i]) { ',' -> i++; '}' -> { i++; return m }; else -> malformed("metadata JSON: expected ',' or '}' at $i") }
            }
        }

        fun arr(depth: Int): List<Any?> {
            if (depth > MAX_DEPTH) malformed("metadata JSON nested deeper than $MAX_DEPTH")
            val l = ArrayList<Any?>()
            i++
            ws()
            if (i < s.length && s[i] == ']') { i++; return l }
            while (true) {
                ws()
                l.add(value(depth + 1))
                ws()
                if (i >= s.length) malformed("metadata JSON: unterminated array")
                when (s[i]) { ',' -> i++; ']' -> { i++; return l }; else -> malformed("metadata JSON: expected ',' or ']' at $i") }
            }
        }

        fun hex4(): Int {
            if (i + 4 > s.length) malformed("metadata JSON: bad \\u escape")
            var v = 0
            for (k in 0 until 4) {
                val d = Character.digit(s[i + k], 16)
                if (d < 0) malformed("metadata JSON: bad \\u escape")
                v = v * 16 + d
            }
            i += 4
            return v
        }

        fun str(): String {
            i++
            val sb = StringBuilder()
            while (true) {
                if (i >= s.length) malformed("metadata JSON: unterminated string")
                val c = s[i++]
                when {
                    c == '"' -> return sb.toString()
                    c == '\\' -> {
                        if (i >= s.length) malformed("metadata JSON: bad escape")
                        when (s[i++]) {
                            '"' -> sb.append('"'); '\\' -> sb.append('\\'); '/' -> sb.append('/')
                            'b' -> sb.append('\b'); 'f' -> sb.append('\u000c'); 'n' -> sb.append('\n')
                            'r' -> sb.append('\r'); 't' -> sb.append('\t')
                            'u' -> {
                                val u = hex4()
                                if (u in 0xD800..0xDBFF) {
                                    if (i + 6 <= s.length && s[i] == '\\' && s[i + 1] == 'u') {
                                        i += 2
                                        val lo = hex4()
                                        if (lo !in 0xDC00..0xDFFF) malformed("metadata JSON: unpaired surrogate escape")
                                        sb.append(u.toChar()).append(lo.toChar())
                                    } else malformed("metadata JSON: unpaired surrogate escape")
                                } else if (u in 0xDC00..0xDFFF) {
                                    malformed("metadata JSON: unpaired surrogate escape")
                                } else sb.append(u.toChar())
                            }
                            else -> malformed("metadata JSON: bad escape at ${i - 1}")
                        }
                    }
                    c < ' ' -> malformed("metadata JSON: control character in string")
                    else -> sb.append(c)
                }
            }
        }

        fun num(): Any {
            val start = i
            if (s[i] == '-') i++
            if (i >= s.length) malformed("metadata JSON: bad number")
            if (s[i] == '0') i++
            else if (s[i] in '1'..'9') { while (i < s.length && s[i] in '0'..'9') i++ }
            else malformed("metadata JSON: bad number at $start")
            var isInt = true
            if (i < s.length && s[i] == '.') {
                isInt = false; i++
                if (i >= s.length || s[i] !in '0'..'9') malformed("metadata JSON: bad number at $start")
                while (i < s.length && s[i] in '0'..'9') i++
            }
            if (i < s.length && (s[i] == 'e' || s[i] == 'E')) {
                isInt = false; i++
                if (i < s.length && (s[i] == '+' || s[i] == '-')) i++
                if (i >= s.length || s[i] !in '0'..'9') malformed("metadata JSON: bad number at $start")
                while (i < s.length && s[i] in '0'..'9') i++
            }
            val t = s.substring(start, i)
            if (isInt) {
                val b = BigInteger(t)
                if (b.bitLength() > 63) malformed("metadata integer $t does not fit in 64 bits")
                return b.toLong()
            }
            val d = t.toDouble()
            if (d.isInfinite()) malformed("metadata number $t overflows a double")
            return d
        }
    }
}
