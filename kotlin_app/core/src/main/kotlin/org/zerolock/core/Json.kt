package org.zerolock.core

/**
 * Minimal JSON reader/writer (no dependencies, usable on Android and the JVM), lenient: for test
 * vectors, manifests and telemetry written by Python's json module.
 *
 * Values map to: null, Boolean, Long (integers without fraction/exponent that fit), Double,
 * String, List<Any?>, LinkedHashMap<String, Any?> (key order kept). NaN / Infinity / -Infinity
 * are accepted as Python's json module writes them; an integer too big for a Long becomes a
 * Double; a repeated key keeps its last value. Errors are [JsonError].
 *
 * Frame metadata uses the same scanner and writer in strict mode (protocol/MetaJson.kt).
 */
object Json {
    class JsonError(message: String) : IllegalArgumentException(message)

    /** Nesting limit of the lenient reader (deep enough for any manifest; no stack overflow). */
    const val MAX_DEPTH = 512

    fun parse(text: String): Any? {
        val p = JsonScanner(text, strict = false, maxDepth = MAX_DEPTH) { msg, at -> throw JsonError("$msg at offset $at") }
        p.ws()
        val v = p.value(1)
        p.ws()
        if (p.i != text.length) p.fail("trailing data")
        return v
    }

    /** Keys in insertion order; NaN / Infinity written as Python's json module does. */
    fun write(value: Any?): String = StringBuilder().also { writeTo(it, value) }.toString()

    fun writeTo(sb: StringBuilder, value: Any?) = JsonText.write(sb, value, strict = false, depth = 1)
}

/**
 * The one JSON scanner of the core (RFC 8259 grammar), for [Json] (lenient) and frame metadata
 * (`protocol.MetaJson`, [strict]: PROTOCOL.md 3.1). Strict mode adds: no NaN / Infinity, integers
 * must fit int64, floats must be finite, no duplicate keys, no lone surrogate escapes, depth <=
 * [maxDepth]. [onError] receives the message and the offset and must throw.
 */
internal class JsonScanner(
    private val s: String,
    private val strict: Boolean,
    private val maxDepth: Int,
    private val onError: (String, Int) -> Nothing,
) {
    var i = 0

    fun fail(msg: String): Nothing = onError(msg, i)

    fun ws() { while (i < s.length && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) i++ }

    fun value(depth: Int): Any? {
        if (i >= s.length) fail("unexpected end")
        return when (val c = s[i]) {
            '{' -> obj(depth)
            '[' -> arr(depth)
            '"' -> str()
            't' -> lit("true", true)
            'f' -> lit("false", false)
            'n' -> lit("null", null)
            'N' -> if (strict) fail("NaN is not JSON") else lit("NaN", Double.NaN)
            'I' -> if (strict) fail("Infinity is not JSON") else lit("Infinity", Double.POSITIVE_INFINITY)
            else -> if (c == '-' || c in '0'..'9') num() else fail("unexpected character ${org.zerolock.core.protocol.Quote.quote(c.toString())}")
        }
    }

    private fun lit(word: String, v: Any?): Any? {
        if (!s.startsWith(word, i)) fail("bad literal")
        i += word.length
        return v
    }

    private fun obj(depth: Int): LinkedHashMap<String, Any?> {
        if (depth > maxDepth) fail("nested deeper than $maxDepth")
        val m = LinkedHashMap<String, Any?>()
        i++
        ws()
        if (i < s.length && s[i] == '}') { i++; return m }
        while (true) {
            ws()
            if (i >= s.length || s[i] != '"') fail("expected a key")
            val k = str()
            ws()
            if (i >= s.length || s[i] != ':') fail("expected ':'")
            i++
            ws()
            if (strict && m.containsKey(k)) fail("duplicate key ${org.zerolock.core.protocol.Quote.quote(k)}")
            m[k] = value(depth + 1)
            ws()
            if (i >= s.length) fail("unterminated object")
            when (s[i]) { ',' -> i++; '}' -> { i++; return m }; else -> fail("expected ',' or '}'") }
        }
    }

    private fun arr(depth: Int): List<Any?> {
        if (depth > maxDepth) fail("nested deeper than $maxDepth")
        val l = ArrayList<Any?>()
        i++
        ws()
        if (i < s.length && s[i] == ']') { i++; return l }
        while (true) {
            ws()
            l.add(value(depth + 1))
            ws()
            if (i >= s.length) fail("unterminated array")
            when (s[i]) { ',' -> i++; ']' -> { i++; return l }; else -> fail("expected ',' or ']'") }
        }
    }

    private fun hex4(): Int {
        if (i + 4 > s.length) fail("bad \\u escape")
        var v = 0
        for (k in 0 until 4) {
            val d = Character.digit(s[i + k], 16)
            if (d < 0) fail("bad \\u escape")
            v = v * 16 + d
        }
        i += 4
        return v
    }

    private fun str(): String {
        i++
        val sb = StringBuilder()
        while (true) {
            if (i >= s.length) fail("unterminated string")
            val c = s[i++]
            when {
                c == '"' -> return sb.toString()
                c == '\\' -> {
                    if (i >= s.length) fail("bad escape")
                    when (s[i++]) {
                        '"' -> sb.append('"'); '\\' -> sb.append('\\'); '/' -> sb.append('/')
                        'b' -> sb.append('\b'); 'f' -> sb.append('\u000c'); 'n' -> sb.append('\n')
                        'r' -> sb.append('\r'); 't' -> sb.append('\t')
                        'u' -> {
                            val u = hex4()
                            if (strict && u in 0xD800..0xDBFF) {
                                if (i + 6 <= s.length && s[i] == '\\' && s[i + 1] == 'u') {
                                    i += 2
                                    val lo = hex4()
                                    if (lo !in 0xDC00..0xDFFF) fail("unpaired surrogate escape")
                                    sb.append(u.toChar()).append(lo.toChar())
                                } else fail("unpaired surrogate escape")
                            } else if (strict && u in 0xDC00..0xDFFF) {
                                fail("unpaired surrogate escape")
                            } else sb.append(u.toChar())
                        }
                        else -> { i--; fail("bad escape") }
                    }
                }
                c < ' ' -> fail("control character in string")
                else -> sb.append(c)
            }
        }
    }

    private fun num(): Any {
        val start = i
        if (s[i] == '-') {
            i++
            if (!strict && s.startsWith("Infinity", i)) { i += 8; return Double.NEGATIVE_INFINITY }
        }
        if (i >= s.length) fail("bad number")
        if (s[i] == '0') i++
        else if (s[i] in '1'..'9') { while (i < s.length && s[i] in '0'..'9') i++ }
        else { i = start; fail("bad number") }
        var isInt = true
        if (i < s.length && s[i] == '.') {
            isInt = false; i++
            if (i >= s.length || s[i] !in '0'..'9') { i = start; fail("bad number") }
            while (i < s.length && s[i] in '0'..'9') i++
        }
        if (i < s.length && (s[i] == 'e' || s[i] == 'E')) {
            isInt = false; i++
            if (i < s.length && (s[i] == '+' || s[i] == '-')) i++
            if (i >= s.length || s[i] !in '0'..'9') { i = start; fail("bad number") }
            while (i < s.length && s[i] in '0'..'9') i++
        }
        val t = s.substring(start, i)
        if (isInt) {
            t.toLongOrNull()?.let { return it }
            if (strict) { i = start; fail("integer $t does not fit in 64 bits") }
        }
        val d = t.toDouble()
        if (strict && d.isInfinite()) { i = start; fail("number $t overflows a double") }
        return d
    }
}

/**
 * The one JSON writer: lenient ([Json.write]: keys in insertion order, NaN / Infinity as Python
 * writes them) or strict (frame metadata: sorted keys, no NaN / Infinity, no unpaired surrogate,
 * depth <= 32; violations are IllegalArgumentException, a bug of the sender). Non-ASCII is kept.
 */
internal object JsonText {
    const val STRICT_MAX_DEPTH = 32

    fun write(sb: StringBuilder, v: Any?, strict: Boolean, depth: Int) {
        when (v) {
            null -> sb.append("null")
            is Boolean -> sb.append(v)
            is Long, is Int, is Short, is Byte -> sb.append(v.toString())
            is Double, is Float -> {
                val d = (v as Number).toDouble()
                when {
                    d.isNaN() -> { require(!strict) { "NaN/Infinity cannot be sent in metadata" }; sb.append("NaN") }
                    d.isInfinite() -> {
                        require(!strict) { "NaN/Infinity cannot be sent in metadata" }
                        sb.append(if (d > 0) "Infinity" else "-Infinity")
                    }
                    else -> sb.append(d.toString()) // always has '.' or 'E': stays a float on the other side
                }
            }
            is Number -> if (strict) throw IllegalArgumentException("cannot encode ${v::class.java.name} in metadata") else sb.append(v.toString())
            is String -> writeString(sb, v, strict)
            is Map<*, *> -> {
                require(!strict || depth <= STRICT_MAX_DEPTH) { "metadata nested deeper than $STRICT_MAX_DEPTH" }
                sb.append('{')
                val keys = v.keys.map { it as? String ?: if (strict) throw IllegalArgumentException("metadata keys must be strings") else it.toString() }
                val order = if (strict) keys.sorted() else keys
                order.forEachIndexed { idx, k ->
                    if (idx > 0) sb.append(',')
                    writeString(sb, k, strict); sb.append(':'); write(sb, v[k], strict, depth + 1)
                }
                sb.append('}')
            }
            is Iterable<*> -> {
                require(!strict || depth <= STRICT_MAX_DEPTH) { "metadata nested deeper than $STRICT_MAX_DEPTH" }
                sb.append('[')
                v.forEachIndexed { idx, x -> if (idx > 0) sb.append(','); write(sb, x, strict, depth + 1) }
                sb.append(']')
            }
            is FloatArray -> write(sb, v.toList(), strict, depth)
            is DoubleArray -> write(sb, v.toList(), strict, depth)
            is IntArray -> write(sb, v.toList(), strict, depth)
            is LongArray -> write(sb, v.toList(), strict, depth)
            is Array<*> -> write(sb, v.toList(), strict, depth)
            else -> if (strict) throw IllegalArgumentException("cannot encode ${v::class.java.name} in metadata")
                    else throw Json.JsonError("cannot write ${v::class.java.name} as JSON")
        }
    }

    private fun writeString(sb: StringBuilder, s: String, strict: Boolean) {
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
                strict && Character.isHighSurrogate(c) -> {
                    require(i + 1 < s.length && Character.isLowSurrogate(s[i + 1])) { "unpaired surrogate in string" }
                    sb.append(c).append(s[i + 1]); i++
                }
                strict && Character.isLowSurrogate(c) -> throw IllegalArgumentException("unpaired surrogate in string")
                else -> sb.append(c)
            }
            i++
        }
        sb.append('"')
    }
}

/** Typed accessors over parsed JSON objects; they throw [Json.JsonError] naming the key. */
fun Map<String, Any?>.num(key: String): Number =
    this[key] as? Number ?: throw Json.JsonError("'$key' must be a number, got ${this[key]}")
fun Map<String, Any?>.numOrNull(key: String): Number? =
    when (val v = this[key]) { null -> null; is Number -> v; else -> throw Json.JsonError("'$key' must be a number or null") }
fun Map<String, Any?>.str(key: String): String =
    this[key] as? String ?: throw Json.JsonError("'$key' must be a string, got ${this[key]}")
fun Map<String, Any?>.long(key: String): Long {
    val n = num(key)
    if (n is Long || n is Int) return n.toLong()
    val d = n.toDouble()
    if (d != Math.floor(d) || d.isInfinite()) throw Json.JsonError("'$key' must be an integer")
    return d.toLong()
}
@Suppress("UNCHECKED_CAST")
fun Any?.asObject(what: String = "value"): Map<String, Any?> =
    this as? Map<String, Any?> ?: throw Json.JsonError("$what must be a JSON object")
