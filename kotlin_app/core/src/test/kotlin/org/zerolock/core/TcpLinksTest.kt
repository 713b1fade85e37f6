package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertNull
import org.junit.jupiter.api.DynamicTest
import org.junit.jupiter.api.Test
import org.junit.jupiter.api.TestFactory
import org.zerolock.core.device.InboundLink
import org.zerolock.core.protocol.ErrorCode
import org.zerolock.core.protocol.FrameReader
import org.zerolock.core.protocol.FrameWriter
import org.zerolock.core.protocol.Frames
import org.zerolock.core.protocol.Handshake
import org.zerolock.core.protocol.Message
import org.zerolock.core.protocol.Messages
import org.zerolock.core.protocol.MsgType
import org.zerolock.core.protocol.ProtocolException
import org.zerolock.core.protocol.Tensor
import org.zerolock.core.protocol.hostHandshake
import java.net.InetAddress
import java.net.Socket
import java.net.SocketTimeoutException

/**
 * The TCP layer of the stage links (device/TcpLinks.kt) over loopback: the rules run on the pure
 * classes in [LinkRulesVectorsTest]; here one inbound scenario of tests/vectors/link_rules/link_rules.json
 * goes through the real [InboundLink] (refusals answered ERROR UNEXPECTED, the link closed), and the
 * data port's connection cap holds. The outbound side over loopback: ShapedLinkTest, DeviceServerTest.
 * As tests/test_links_tcp.py for zl_mobile/links.py.
 */
class TcpLinksTest {
    private val v = Json.parse(TestSupport.file("tests/vectors/link_rules/link_rules.json").readText()).asObject()

    @Suppress("UNCHECKED_CAST")
    private fun longs(x: Any?): List<Long> = (x as List<Number>).map { it.toLong() }

    /** How many of [socks] the link still holds open, once [want] are (or 3 s have passed), with
     *  0.3 s more for a late close: a closed one reads end-of-stream (or a reset). */
    private fun held(socks: List<Socket>, closed: MutableSet<Int>, want: Int): Int {
        fun probe() {
            for ((i, s) in socks.withIndex()) {
                if (i in closed) continue
                s.soTimeout = 1
                try { if (s.getInputStream().read() < 0) closed += i } catch (_: SocketTimeoutException) {} catch (_: java.io.IOException) { closed += i }
            }
        }
        val end = System.currentTimeMillis() + 3000
        while (true) {
            probe()
            if (socks.size - closed.size <= want || System.currentTimeMillis() > end) break
            Thread.sleep(20)
        }
        Thread.sleep(300)
        probe()
        return socks.size - closed.size
    }

    /** PROTOCOL.md 6 on the real device.InboundLink: its data port holds at most max_connections; at
     *  the cap the oldest unauthenticated connection gives way, so idle sockets never keep the upstream out. */
    @Suppress("UNCHECKED_CAST")
    @TestFactory
    fun `inbound connection cap`(): List<DynamicTest> = ((v["inbound"].asObject())["connections"] as List<Any?>).map { sc ->
        val s = sc.asObject()
        DynamicTest.dynamicTest(s.str("name")) {
            val token = Handshake.newToken()
            val queue = InboundQueue<Message>()
            val link = InboundLink(s.str("link"), token, queue, 2, nextNeeded = { queue.nextAfter(0) },
                bind = InetAddress.getLoopbackAddress(), maxConnections = s.long("max_connections").toInt())
            val idle = mutableListOf<Socket>()
            val closed = HashSet<Int>()
            var up: Upstream? = null
            try {
                for ((i, st) in (s["steps"] as List<Any?>).withIndex()) {
                    val step = st.asObject()
                    val where = "${s.str("name")}, step $i $step"
                    when (step.str("do")) {
                        "idle" -> repeat(step.long("n").toInt()) { idle += Socket(InetAddress.getLoopbackAddress(), link.port) }
                        "connect" -> up = Upstream(link.port, token)
                        else -> error("unknown step in $where")
                    }
                    val want = step.long("held").toInt()
                    assertEquals(want, held(idle, closed, want), where)
                }
                up?.let { assertEquals(2L, it.credit(), "the authenticated upstream was never the one to give way") }
            } finally {
                idle.forEach { it.close() }
                up?.close()
                link.close()
            }
        }
    }


    /** The upstream end of one connection to an [InboundLink] (BUSY while the last one's slot is freed). */
    private class Upstream(port: Int, token: String) : AutoCloseable {
        val s: Socket
        val r: FrameReader
        val w: FrameWriter
        init {
            val end = System.currentTimeMillis() + 10_000
            while (true) {
                val c = Socket(InetAddress.getLoopbackAddress(), port).also { it.soTimeout = 10_000 }
                val cr = FrameReader(c.getInputStream().buffered(), Frames.PREAUTH_MAX_FRAME)
                val cw = FrameWriter(c.getOutputStream().buffered())
                try { hostHandshake(cr, cw, token, "upstream") } catch (e: ProtocolException) {
                    c.close()
                    if (e.code != ErrorCode.BUSY || System.currentTimeMillis() > end) throw e
                    Thread.sleep(20)
                    continue
                }
                s = c; r = cr; w = cw
                break
            }
            r.maxFrame = Frames.DEFAULT_MAX_FRAME
            assertEquals(MsgType.REPLAY_REQUEST, r.read().type)
        }

        /** The CREDIT the link sends next (null: nothing within 300 ms). */
        fun credit(): Long? {
            s.soTimeout = 300
            val m = try { r.read() } catch (_: SocketTimeoutException) { return null } finally { s.soTimeout = 10_000 }
            assertEquals(MsgType.CREDIT, m.type, m.toString())
            return m.long("credits")
        }

        override fun close() = s.close()
    }

    /** PROTOCOL.md 5.4.1 on the real device.InboundLink: a HIDDEN_STATE beyond the credits, or one
     *  the stage cannot use ([LinkRules.unusable], what StageRuntime checks), is answered ERROR
     *  UNEXPECTED, is not kept, and the link closes. */
    @Suppress("UNCHECKED_CAST")
    @Test
    fun `inbound credits over TCP`() {
        val s = ((v["inbound"].asObject())["credits"] as List<Any?>).map { it.asObject() }
            .first { it.str("name").startsWith("a HIDDEN_STATE beyond the credits granted is refused") }
        run {
            val token = Handshake.newToken()
            val w = s.long("window_size").toInt()
            val depth = s.long("inflight_depth").toInt()
            val total = (s["total_micro_batches"] as Number?)?.toLong()
            val queue = InboundQueue<Message>()
            var next = (s.long("committed_window") + 1) * w // the micro-batch the stage needs next
            val link = InboundLink(s.str("link"), token, queue, depth, nextNeeded = { queue.nextAfter(next) },
                bind = InetAddress.getLoopbackAddress(),
                unusable = { m -> LinkRules.unusable(m.long("micro_batch"), m.long("window"), next, depth, w, total) })
            var up: Upstream? = null
            try {
                for ((i, st) in (s["steps"] as List<Any?>).withIndex()) {
                    val step = st.asObject()
                    val where = "${s.str("name")}, step $i $step"
                    when (step.str("do")) {
                        "connect" -> {
                            up?.close()
                            up = Upstream(link.port, token)
                            assertEquals((step["credit"] as Number?)?.toLong(), up!!.credit(), where)
                        }
                        "send" -> {
                            val mb = step.long("mb")
                            val window = (step["window"] as Number?)?.toLong() ?: (mb / w)
                            up!!.w.write(Messages.hiddenState(mb, window, Tensor.ofFloats(floatArrayOf(mb.toFloat(), mb.toFloat()), 1, 2)))
                            (step["refused"] as String?)?.let { refused ->
                                val e = up!!.r.read()
                                assertEquals(MsgType.ERROR, e.type, "$where: $e")
                                assertEquals("UNEXPECTED", e.string("code"), where)
                                assertEquals(refused, e.string("message"), where)
                                assertThrows<Exception> { up!!.r.read() } // the link closed
                                up!!.close()
                                up = null
                            }
                        }
                        "take" -> {
                            val mb = step.long("mb")
                            assertEquals(mb, queue.take(mb, 10_000)?.long("micro_batch"), where)
                            next = mb + 1 // as the stage: its next moves before the credit goes out
                            link.grant(1)
                            assertEquals((step["credit"] as Number?)?.toLong(), up!!.credit(), where)
                        }
                        else -> error("unknown step in $where")
                    }
                    step["queued"]?.let { want ->
                        val end = System.currentTimeMillis() + 10_000
                        while (queue.ids() != longs(want) && System.currentTimeMillis() < end) Thread.sleep(5)
                        assertEquals(longs(want), queue.ids(), "queued: $where")
                    }
                }
                up?.let { assertNull(it.credit(), "nothing refused that the scenario did not expect") }
            } finally {
                up?.close()
                link.close()
            }
        }
    }

}
