package org.zerolock.core

/**
 * Minimal JSON reader/writer (no dependencies, usable on Android and the JVM).
 *
 * Values map to: null, Boolean, Long (integers without fraction/exponent that fit), Double,
 * String, List<Any?>, LinkedHashMap<String, Any?> (key order kept). NaN / Infinity / -Infinity
 * are accepted as Python's json module writes them.
 */
object Json {
    class JsonError(message: String) : IllegalArgumentException(message)

    fun parse(text: String): Any? {
        val p = Parser(text)
        p.ws()
        val v = p.value()
        p.ws()
        if (p.i != text.length) throw JsonError("trailing data at ${p.i}")
        return v
    }

    fun write(value: Any?): String = StringBuilder().also { writeTo(it, value) }.toString()

    fun writeTo(sb: StringBuilder, value: Any?) {
        when (value) {
            null -> sb.append("null")
            is Boolean -> sb.append(value)
            is Int, is Long, is Short, is Byte -> sb.append(value.toString())
            is Float -> writeDouble(sb, value.toDouble())
            is Double -> writeDouble(sb, value)
            is Number -> sb.append(value.toString())
            is String -> writeString(sb, value)
            is Map<*, *> -> {
                sb.append('{')
                var first = true
                for ((k, v) in value) {
                    if (!first) sb.append(',')
                    first = false
                    writeString(sb, k.toString())
                    sb.append(':')
                    writeTo(sb, v)
                }
                sb.append('}')
            }
            is Iterable<*> -> {
                sb.append('[')
                var first = true
                for (v in value) {
                    if (!first) sb.append(',')
                    first = false
                    writeTo(sb, v)
                }
                sb.append(']')
            }
            is FloatArray -> writeTo(sb, value.toList())
            is DoubleArray -> writeTo(sb, value.toList())
            is IntArray -> writeTo(sb, value.toList())
            is LongArray -> writeTo(sb, value.toList())
            is Array<*> -> writeTo(sb, value.toList())
            else -> throw JsonError("cannot write ${value::class.java.name} as JSON")
        }
    }

    private fun writeDouble(sb: StringBuilder, d: Double) {
        when {
            d.isNaN() -> sb.append("NaN")
            d == Double.POSITIVE_INFINITY -> sb.append("Infinity")
            d == Double.NEGATIVE_INFINITY -> sb.append("-Infinity")
            else -> sb.append(d.toString())
        }
    }

    private fun writeString(sb: StringBuilder, s: String) {
        sb.append('"')
        for (c in s) {
            when (c) {
                '"' -> sb.append("\\\"")
                '\\' -> sb.append("\\\\")
                '\n' -> sb.append("\\n")
                '\r' -> sb.append("\\r")
                '\t' -> sb.append("\\t")
                '\b' -> sb.append("\\b")
                '\u000c' -> sb.append("\\f")
                else -> if (c < ' ') sb.append(String.format("\\u%04x", c.code)) else sb.append(c)
            }
        }
        sb.append('"')
    }

    private class Parser(val s: String) {
        var i = 0

        fun ws() {
            while (i < s.length && (s[i] == ' ' || s[i] == '\n' || s[i] == '\r' || s[i] == '\t')) i++
        }

        fun fail(msg: String): Nothing = throw JsonError("$msg at offset $i")

        fun value(): Any? {
            if (i >= s.length) fail("unexpected end")
            return when (val c = s[i]) {
                '{' -> obj()
                '[' -> arr()
                '"' -> str()
                't' -> lit("true", true)
                'f' -> lit("false", false)
                'n' -> lit("null", null)
                'N' -> lit("NaN", Double.NaN)
                'I' -> lit("Infinity", Double.POSITIVE_INFINITY)
                else -> if (c == '-' || c in '0'..'9') num() else fail("unexpected '$c'")
            }
        }

        fun lit(word: String, v: Any?): Any? {
            if (!s.startsWith(word, i)) fail("bad literal")
            i += word.length
            return v
        }

        fun obj(): Map<String, Any?> {
            val m = LinkedHashMap<String, Any?>()
            i++
            ws()
            if (i < s.length && s[i] == '}') { i++; return m }
            while (true) {
                ws()
                if (i >= s.length || s[i] != '"') fail("expected key")
                val k = str()
                ws()
                if (i >= s.length || s[i] != ':') fail("expected ':'")
                i++
                ws()
                m[k] = value()
                ws()
                if (i >= s.length) fail("unterminated object")
                when (s[i]) {
                    ',' -> i++
                    '}' -> { i++; return m }
                    else -> fail("expected ',' or '}'")
                }
            }
        }

        fun arr(): List<Any?> {
            val l = ArrayList<Any?>()
            i++
            ws()
            if (i < s.length && s[i] == ']') { i++; return l }
            while (true) {
                ws()
                l.add(value())
                ws()
                if (i >= s.length) fail("unterminated array")
                when (s[i]) {
                    ',' -> i++
                    ']' -> { i++; return l }
                    else -> fail("expected ',' or ']'")
                }
            }
        }

        fun str(): String {
            i++
            val sb = StringBuilder()
            while (true) {
                if (i >= s.length) fail("unterminated string")
                val c = s[i++]
                when {
                    c == '"' -> return sb.toString()
                    c == '\\' -> {
                        if (i >= s.length) fail("bad escape")
                        when (val e = s[i++]) {
                            '"' -> sb.append('"'); '\\' -> sb.append('\\'); '/' -> sb.append('/')
                            'b' -> sb.append('\b'); 'f' -> sb.append('\u000c'); 'n' -> sb.append('\n')
                            'r' -> sb.append('\r'); 't' -> sb.append('\t')
                            'u' -> {
                                if (i + 4 > s.length) fail("bad \\u escape")
                                sb.append(s.substring(i, i + 4).toInt(16).toChar())
                                i += 4
                            }
                            else -> fail("bad escape '\\$e'")
                        }
                    }
                    c < ' ' -> fail("control character in string")
                    else -> sb.append(c)
                }
            }
        }

        fun num(): Any {
            val start = i
            if (s[i] == '-') {
                i++
                if (s.startsWith("Infinity", i)) { i += 8; return Double.NEGATIVE_INFINITY }
            }
            var isInt = true
            while (i < s.length && s[i] in '0'..'9') i++
            if (i < s.length && s[i] == '.') { isInt = false; i++; while (i < s.length && s[i] in '0'..'9') i++ }
            if (i < s.length && (s[i] == 'e' || s[i] == 'E')) {
                isInt = false
                i++
                if (i < s.length && (s[i] == '+' || s[i] == '-')) i++
                while (i < s.length && s[i] in '0'..'9') i++
            }
            val t = s.substring(start, i)
            if (t == "-" || t.isEmpty()) fail("bad number")
            if (isInt) t.toLongOrNull()?.let { return it }
            return t.toDoubleOrNull() ?: fail("bad number '$t'")
        }
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
