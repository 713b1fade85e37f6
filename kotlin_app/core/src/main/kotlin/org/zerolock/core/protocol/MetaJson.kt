package org.zerolock.core.protocol

import org.zerolock.core.JsonScanner
import org.zerolock.core.JsonText
import java.nio.ByteBuffer
import java.nio.charset.CharacterCodingException
import java.nio.charset.CodingErrorAction

/**
 * Strict JSON for frame metadata (PROTOCOL.md 3.1): UTF-8 without BOM, RFC 8259 grammar, no
 * duplicate keys, no NaN/Infinity, integers fit int64, floats finite, no lone surrogates,
 * depth <= 32. Every violation is [ErrorCode.MALFORMED].
 *
 * The core's one JSON scanner and writer (org.zerolock.core.Json.kt) in strict mode; this file
 * adds the byte-level rules (UTF-8, BOM, a top-level object) and the MALFORMED error code.
 *
 * Values: null, Boolean, Long (integer tokens), Double (tokens with fraction or exponent),
 * String, List<Any?>, LinkedHashMap<String, Any?>.
 */
object MetaJson {
    const val MAX_DEPTH = JsonText.STRICT_MAX_DEPTH

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
        val p = JsonScanner(text, strict = true, maxDepth = MAX_DEPTH) { msg, at -> malformed("metadata JSON: $msg at $at") }
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
        JsonText.write(sb, meta, strict = true, depth = 1)
        return sb.toString().toByteArray(Charsets.UTF_8)
    }
}
