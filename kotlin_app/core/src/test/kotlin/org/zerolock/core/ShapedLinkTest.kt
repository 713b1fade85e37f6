package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.Test
import org.zerolock.core.device.DelayLine
import org.zerolock.core.device.InboundLink
import org.zerolock.core.device.LinkShaping
import org.zerolock.core.device.OutboundLink
import org.zerolock.core.protocol.Frames
import org.zerolock.core.protocol.Message
import org.zerolock.core.protocol.Messages
import org.zerolock.core.protocol.RateLimiter
import org.zerolock.core.protocol.Tensor
import java.net.InetAddress

/**
 * DeviceMain --rate-mbit / --link-delay-ms on real loopback stage links (zl_mobile's RateLimiter and
 * DelayLine): the same transfer unshaped, paced and delayed, compared in one test with loose bounds.
 */
class ShapedLinkTest {
    private val token = "5a".repeat(32)
    private val frames = 8
    private val floats = 32 * 1024 // 128 KiB of h per frame, 1 MiB in all

    /** Seconds from connecting to the last of [frames] hidden states taken downstream (credits returned as taken); and their frames' bytes. */
    private fun transfer(shaping: LinkShaping, depth: Int = 2): Pair<Double, Long> {
        val queue = InboundQueue<Message>()
        val inbound = InboundLink("in", token, queue, inflightDepth = depth, nextNeeded = { queue.nextAfter(0) },
            bind = InetAddress.getLoopbackAddress(), delay = shaping.delay)
        val out = OutboundLink("out", token, windowSize = 2, replayHorizon = 64, pruneOnCommit = false,
            limiter = shaping.limiter, delay = shaping.delay)
        try {
            var bytes = 0L
            for (mb in 0L until frames) {
                val h = Messages.hiddenState(mb, mb / 2, Tensor.ofFloats(FloatArray(floats) { mb + it * 1e-3f }, 1, floats.toLong()))
                bytes += Frames.encode(h).size
                out.publish(h)
            }
            val t0 = System.nanoTime()
            out.setAddress("127.0.0.1:${inbound.port}")
            for (mb in 0L until frames) {
                val m = queue.take(mb, 30_000) ?: throw AssertionError("micro-batch $mb never arrived")
                assertEquals(mb, m.long("micro_batch"))
                inbound.grant(1)
            }
            return Pair((System.nanoTime() - t0) / 1e9, bytes)
        } finally {
            out.close()
            inbound.close()
        }
    }

    @Test
    fun `a paced link takes the time its rate gives, a delayed one pays the latency on every credit round`() {
        transfer(LinkShaping()) // warm the JIT and the loopback path
        val (plain, bytes) = transfer(LinkShaping())
        assertTrue(bytes >= frames * floats * 4L, "sent $bytes bytes")

        val rate = 2_000_000.0 // bytes/s: 16 Mbit/s, --rate-mbit 16
        val limiter = RateLimiter(rate)
        val (paced, _) = transfer(LinkShaping(limiter = limiter))
        val expected = (bytes - maxOf(16.0 * 1024, rate / 20)) / rate // all but the first burst waits (~0.47 s)
        println("ShapedLinkTest: unshaped ${"%.3f".format(plain)} s, at 16 Mbit/s ${"%.3f".format(paced)} s (rate alone: ${"%.3f".format(expected)} s)")
        assertTrue(paced >= 0.9 * expected, "paced $paced s, the rate alone needs $expected s")
        assertTrue(paced - plain >= 0.7 * expected, "pacing added ${paced - plain} s of $expected s")
        assertTrue(paced <= plain + 2 * expected + 1.0, "paced $paced s is far slower than the rate ($expected s)")

        // 100 ms one way, depth 2: the resume point and first credits, then every pair of frames and
        // the credits that let the next pair go are each seen 100 ms late: >= 4 rounds of 2 delays
        val delayMs = 100.0
        val (delayed, _) = transfer(LinkShaping(delay = DelayLine(delayMs)))
        println("ShapedLinkTest: with --link-delay-ms 100 ${"%.3f".format(delayed)} s")
        val rounds = frames / 2
        assertTrue(delayed >= (2 * rounds) * delayMs / 1000 * 0.9, "delayed $delayed s")
        assertTrue(delayed <= plain + (2 * rounds + 2) * delayMs / 1000 + 1.5, "delayed $delayed s: more than the delays explain")
    }

    @Test
    fun `the limiter is zl_mobile's token bucket`() {
        val l = RateLimiter(1_000_000.0) // burst 50 KB
        val t0 = System.nanoTime()
        l.consume(50_000) // within the burst: no wait
        assertTrue(System.nanoTime() - t0 < 20_000_000)
        l.consume(200_000) // 0.2 s of debt
        val s = (System.nanoTime() - t0) / 1e9
        assertTrue(s in 0.18..0.6, "waited $s s")
        assertThrows<IllegalArgumentException> { RateLimiter(0.0) }
    }
}
