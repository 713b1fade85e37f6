package org.zerolock.core.protocol

/** Error codes of docs/PROTOCOL.md section 7. */
enum class ErrorCode {
    TRUNCATED, OVERSIZED, BAD_MAGIC, BAD_VERSION, BAD_CHECKSUM, UNKNOWN_TYPE, MALFORMED,
    UNAUTHENTICATED, BUSY, UNEXPECTED, REJECTED, TIMEOUT, INTERNAL;

    companion object {
        /** An unknown name received from a peer MUST be treated as INTERNAL. */
        fun fromWire(name: String): ErrorCode = values().firstOrNull { it.name == name } ?: INTERNAL
    }
}

/** A protocol failure with its wire code; the message is one line saying what to do. */
open class ProtocolException(val code: ErrorCode, message: String, val requestId: Long? = null) :
    Exception("${code.name}: $message") {
    val detail: String = message

    /** The ERROR message that reports this failure to the peer. */
    fun toMessage(): Message = Messages.error(code, detail, requestId)
}

/** The peer closed the stream cleanly between two frames. */
class ConnectionClosedException(message: String = "connection closed by peer") : java.io.IOException(message)

internal fun malformed(msg: String): Nothing = throw ProtocolException(ErrorCode.MALFORMED, msg)
