package org.zerolock.core.protocol

/**
 * The one rule for showing a peer-supplied value in a message or a log line (ERROR, REJECTED,
 * FILE_RESULT `message`), the same as zl_mobile/protocol/quoting.py and tests/vectors/quoting.json:
 * in double quotes, at most the first [MAX] code points, printable ASCII as itself but `"` and `\`
 * escaped, \n \r \t as such, any other code point as \xNN, \uNNNN or \UNNNNNNNN (lowercase hex);
 * a longer value ends with `...(<code points> chars)`. So a hostile value stays one short line and
 * can neither forge a log line nor drive a terminal.
 */
object Quote {
    const val MAX = 64

    fun quote(value: String): String = "\"" + escaped(value) + "\"" + suffix(value)

    /**
     * Any metadata value: a string as [quote] shows it; a number, bool, list or object as its
     * compact JSON (a number stays unquoted, so it does not read as a string, as zl_mobile's
     * quote_any), escaped and cut after [MAX] characters the same way.
     */
    fun show(value: Any?): String = if (value is String) quote(value) else {
        val text = org.zerolock.core.Json.write(value)
        escaped(text, json = true) + suffix(text)
    }

    private fun suffix(value: String): String {
        val total = value.codePointCount(0, value.length)
        return if (total > MAX) "...($total chars)" else ""
    }

    /** [json]: the text is JSON already (its quotes and backslashes are its own): only what is not printable ASCII is escaped. */
    private fun escaped(value: String, json: Boolean = false): String {
        val sb = StringBuilder(minOf(value.length, MAX) + 2)
        var i = 0
        var n = 0
        while (i < value.length && n < MAX) {
            val cp = value.codePointAt(i)
            i += Character.charCount(cp)
            n++
            when {
                cp == '"'.code && !json -> sb.append("\\\"")
                cp == '\\'.code && !json -> sb.append("\\\\")
                cp == '\n'.code -> sb.append("\\n")
                cp == '\r'.code -> sb.append("\\r")
                cp == '\t'.code -> sb.append("\\t")
                cp in 0x20..0x7e -> sb.append(cp.toChar())
                cp < 0x100 -> sb.append("\\x").append(hex(cp, 2))
                cp < 0x10000 -> sb.append("\\u").append(hex(cp, 4))
                else -> sb.append("\\U").append(hex(cp, 8))
            }
        }
        return sb.toString()
    }

    private fun hex(v: Int, width: Int): String = Integer.toHexString(v).padStart(width, '0')
}
