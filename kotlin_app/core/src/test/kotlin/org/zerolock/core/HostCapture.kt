package org.zerolock.core

import org.zerolock.core.protocol.ConnectionClosedException
import org.zerolock.core.protocol.FrameReader
import org.zerolock.core.protocol.FrameWriter
import org.zerolock.core.protocol.Frames
import org.zerolock.core.protocol.Message
import java.io.ByteArrayInputStream
import java.io.ByteArrayOutputStream
import java.io.OutputStream

/** Everything a stage writes to the host, decoded in order (the stage tests' host side). */
class HostCapture {
    private val buf = ByteArrayOutputStream()
    val writer = FrameWriter(object : OutputStream() {
        override fun write(b: Int) = synchronized(buf) { buf.write(b) }
        override fun write(b: ByteArray, off: Int, len: Int) = synchronized(buf) { buf.write(b, off, len) }
    })

    fun messages(): List<Message> {
        val r = FrameReader(ByteArrayInputStream(synchronized(buf) { buf.toByteArray() }), Frames.DEFAULT_MAX_FRAME)
        val out = mutableListOf<Message>()
        while (true) out += try { r.read() } catch (_: ConnectionClosedException) { return out }
    }
}
