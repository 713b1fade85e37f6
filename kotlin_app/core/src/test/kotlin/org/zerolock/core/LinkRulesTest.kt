package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertArrayEquals
import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertFalse
import org.junit.jupiter.api.Assertions.assertNull
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.DynamicTest
import org.junit.jupiter.api.Test
import org.junit.jupiter.api.TestFactory
import org.junit.jupiter.api.io.TempDir
import java.io.File

/** tests/vectors/link_rules/link_rules.json on the pure rule classes, no sockets: the scenarios the Python ones
 *  (zl_mobile/link_rules.py) pass too. The TCP layer: [TcpLinksTest]. */
class LinkRulesVectorsTest {
    private val v = Json.parse(TestSupport.file("tests/vectors/link_rules/link_rules.json").readText()).asObject()

    @Suppress("UNCHECKED_CAST")
    private fun longs(x: Any?): List<Long> = (x as List<Number>).map { it.toLong() }

    @Test
    fun `NO_END matches the vectors`() = assertEquals(v.long("no_end"), LinkRules.NO_END)

    @Test
    fun `the data port cap matches the vectors`() = assertEquals(v.long("max_connections"), LinkRules.MAX_CONNECTIONS.toLong())

    @Suppress("UNCHECKED_CAST")
    @TestFactory
    fun `outbound scenarios`(): List<DynamicTest> = (v["outbound"] as List<Any?>).map { sc ->
        val s = sc.asObject()
        DynamicTest.dynamicTest(s.str("name")) {
            val link = OutboundLinkState<String>(s.str("link"), s.long("window_size").toInt(), s.long("replay_horizon").toInt(),
                pruneOnCommit = s["prune_on_commit"] as? Boolean ?: true)
            for ((i, st) in (s["steps"] as List<Any?>).withIndex()) {
                val step = st.asObject()
                val where = "${s.str("name")}, step $i $step"
                var error: String? = null
                var refused: String? = null
                when (step.str("do")) {
                    "publish" -> for (mb in longs(step["mb"])) link.publish(mb, "h$mb")
                    "connect" -> link.connected()
                    "disconnect" -> link.disconnected()
                    "replay_request" -> error = link.onReplayRequest(step.long("from"))
                    "credit" -> link.onCredit(step.long("n"))
                    "committed" -> refused = link.onCommitted(step.long("window"))
                    else -> error("unknown step in $where")
                }
                // the link sends whatever the rules allow, as soon as they allow it
                val sent = generateSequence { link.takeNext() }.map { (mb, h) -> assertEquals("h$mb", h); mb }.toList()
                assertEquals(step["sent"]?.let { longs(it) } ?: emptyList<Long>(), sent, "sent: $where")
                assertEquals(step["error"] as String?, error, "error: $where")
                assertEquals(step["refused"] as String?, refused, "refused: $where")
                step["buffered"]?.let { assertEquals(longs(it), link.buffered(), "buffered: $where") }
                step["full"]?.let { assertEquals(it as Boolean, link.full(), "full: $where") }
            }
        }
    }

    @Suppress("UNCHECKED_CAST")
    @TestFactory
    fun `inbound greetings`(): List<DynamicTest> = ((v["inbound"].asObject())["greeting"] as List<Any?>).map { g ->
        val c = g.asObject()
        DynamicTest.dynamicTest(c.str("name")) {
            val q = InboundQueue<String>()
            for (mb in longs(c["queued"])) q.put(mb, "h$mb")
            val resume = (c.long("committed_window") + 1) * c.long("window_size")
            assertEquals(c.long("replay_from"), q.nextAfter(resume))
            assertEquals((c["initial_credit"] as Number?)?.toLong(), LinkRules.initialCredit(c.long("inflight_depth").toInt(), q.size))
        }
    }


    /** PROTOCOL.md 5.4.1: a HIDDEN_STATE beyond the credits of its connection, or one the stage cannot
     *  use ([LinkRules.unusable], what StageRuntime checks), is refused and not kept, and the
     *  connection ends; a new one starts with the greeting's credit. */
    @Suppress("UNCHECKED_CAST")
    @TestFactory
    fun `inbound credits`(): List<DynamicTest> = ((v["inbound"].asObject())["credits"] as List<Any?>).map { sc ->
        val s = sc.asObject()
        DynamicTest.dynamicTest(s.str("name")) {
            val w = s.long("window_size").toInt()
            val depth = s.long("inflight_depth").toInt()
            val total = (s["total_micro_batches"] as Number?)?.toLong()
            val name = s.str("link")
            val queue = InboundQueue<String>()
            var next = (s.long("committed_window") + 1) * w // the micro-batch the stage needs next
            var credits: InboundCredits? = null // the current connection's (null: no upstream connected)
            for ((i, st) in (s["steps"] as List<Any?>).withIndex()) {
                val step = st.asObject()
                val where = "${s.str("name")}, step $i $step"
                when (step.str("do")) {
                    "connect" -> {
                        val c = InboundCredits(name).also { credits = it }
                        val first = LinkRules.initialCredit(depth, queue.size)
                        first?.let { c.grant(it) }
                        assertEquals((step["credit"] as Number?)?.toLong(), first, where)
                    }
                    "send" -> {
                        val mb = step.long("mb")
                        val window = (step["window"] as Number?)?.toLong() ?: (mb / w)
                        val refused = credits!!.spend(mb)
                            ?: LinkRules.unusable(mb, window, next, depth, w, total)?.let { LinkRules.unusableMessage(mb, name, it) }
                        assertEquals(step["refused"] as String?, refused, where)
                        if (refused == null) queue.put(mb, "h$mb") else credits = null // the link closes
                    }
                    "take" -> {
                        val mb = step.long("mb")
                        assertEquals("h$mb", queue.tryTake(mb), where)
                        next = mb + 1 // as the stage: its next moves before the credit goes out
                        val sent = credits?.let { it.grant(1); 1L }
                        assertEquals((step["credit"] as Number?)?.toLong(), sent, where)
                    }
                    else -> error("unknown step in $where")
                }
                step["queued"]?.let { assertEquals(longs(it), queue.ids(), "queued: $where") }
            }
        }
    }

    @Suppress("UNCHECKED_CAST")
    @Test
    fun `inbound queue steps`() {
        val q = InboundQueue<String>()
        for (st in (v["inbound"].asObject())["queue"] as List<Any?>) {
            val s = st.asObject()
            val mb = s.long("mb")
            when (s.str("do")) {
                "put" -> q.put(mb, "h$mb")
                "take" -> { assertEquals("h${s.long("took")}", q.tryTake(mb), "$s"); assertEquals(s.long("left").toInt(), q.size, "$s") }
                "next_after" -> assertEquals(s.long("next"), q.nextAfter(mb), "$s")
                else -> error("unknown step $s")
            }
        }
    }
}

/** The rules one by one, each test failing if its rule is broken. */
class OutboundLinkStateTest {
    private fun drain(l: OutboundLinkState<String>): List<Long> = generateSequence { l.takeNext() }.map { it.first }.toList()

    private fun connectedLink(w: Int = 2, horizon: Int = 16, published: LongRange = 0L..5L, from: Long = 0): OutboundLinkState<String> {
        val l = OutboundLinkState<String>("stage0-out", w, horizon)
        for (mb in published) l.publish(mb, "h$mb")
        l.connected()
        assertNull(l.onReplayRequest(from))
        return l
    }

    @Test
    fun `prune on commit drops exactly the committed windows`() {
        val l = connectedLink()
        l.onCredit(6)
        assertEquals((0L..5L).toList(), drain(l))
        assertEquals((0L..5L).toList(), l.buffered(), "sent frames stay until the downstream commits")
        l.onCommitted(0)
        assertEquals(listOf(2L, 3L, 4L, 5L), l.buffered())
        assertEquals(2, l.prunedBelow)
        l.onCommitted(0) // repeated: nothing more
        assertEquals(listOf(2L, 3L, 4L, 5L), l.buffered())
        l.onCommitted(2)
        assertEquals(emptyList<Long>(), l.buffered())
        assertEquals(6, l.prunedBelow)
        assertEquals(2, l.downstreamCommitted)
        l.onCommitted(1) // an old commit never moves things back
        assertEquals(2, l.downstreamCommitted)
        assertEquals(6, l.prunedBelow)
    }

    @Test
    fun `replay starts at the downstream's resume point, never before`() {
        val l = connectedLink(from = 4)
        l.onCredit(10)
        assertEquals(listOf(4L, 5L), drain(l), "a live downstream never gets what it did not ask for")
        l.publish(6, "h6")
        assertEquals(listOf(6L), drain(l))
        // reconnect: the restarted downstream asks for its gap only
        l.disconnected(); l.connected()
        assertNull(l.onReplayRequest(2))
        l.onCredit(10)
        assertEquals(listOf(2L, 3L, 4L, 5L, 6L), drain(l))
    }

    @Test
    fun `a request below the pruned micro-batches is an error naming them, then resumes at the first kept one`() {
        val l = connectedLink()
        l.onCredit(6); drain(l)
        l.onCommitted(1)
        l.disconnected(); l.connected()
        assertEquals(
            "replay unavailable: micro-batches 1-3 needed downstream of stage0-out are no longer held " +
                "(it holds 4 onward); the downstream asked below what it had reported committed, " +
                "so its checkpoint or the upstream's replay files were lost: restore that stage's work dir " +
                "or start a new run",
            l.onReplayRequest(1))
        assertEquals(4, l.next)
        l.onCredit(1)
        assertEquals(listOf(4L), drain(l))
    }

    @Test
    fun `at the horizon nothing is dropped, the buffer is full until a commit`() {
        val l = OutboundLinkState<String>("stage1-out", 2, 3)
        for (mb in 0L..2L) l.publish(mb, "h$mb")
        assertTrue(l.full(), "three held, horizon three: the producer waits")
        l.connected(); l.onReplayRequest(0); l.onCredit(2)
        assertEquals(listOf(0L, 1L), drain(l))
        assertEquals((0L..2L).toList(), l.buffered(), "sent but not committed: kept")
        l.onCommitted(0)
        assertEquals(listOf(2L), l.buffered())
        assertFalse(l.full())
    }

    @Test
    fun `credits limit the frames in flight and every connection starts with none`() {
        val l = OutboundLinkState<String>("stage0-out", 2, 16)
        for (mb in 0L..9L) l.publish(mb, "h$mb")
        l.connected()
        l.onCredit(3)
        assertEquals(emptyList<Long>(), drain(l), "nothing before REPLAY_REQUEST")
        l.onReplayRequest(0)
        assertEquals(listOf(0L, 1L, 2L), drain(l))
        assertFalse(l.sendable())
        l.onCredit(1)
        assertEquals(listOf(3L), drain(l))
        l.onCredit(2)
        l.disconnected(); l.connected()
        assertEquals(0, l.credits, "credits do not survive a reconnect")
        l.onReplayRequest(4)
        assertEquals(emptyList<Long>(), drain(l))
        assertThrows<IllegalArgumentException> { l.onCredit(0) }
    }
}

class InboundQueueTest {
    @Test
    fun `take waits, drops older stale entries, and stops`() {
        val q = InboundQueue<String>()
        q.put(1, "h1"); q.put(2, "h2"); q.put(3, "h3")
        assertEquals("h2", q.take(2, 10))
        assertEquals(listOf(3L), q.ids(), "1 was older than 2: dropped")
        Thread { Thread.sleep(50); q.put(4, "h4") }.start()
        assertEquals("h4", q.take(4, 5000))
        assertNull(q.take(9, 20), "timeout")
        q.stop()
        assertNull(q.take(9, 5000))
        val keep = InboundQueue<String>(dropOlder = false)
        keep.put(1, "g1"); keep.put(2, "g2")
        assertEquals("g2", keep.tryTake(2))
        assertEquals("g1", keep.tryTake(1), "gradients are taken in reverse order and all stay")
    }
}

/**
 * A stage restarted after a crash, wired with the link rules: the upstream keeps h until the
 * downstream commits, the restarted downstream asks for (last committed window + 1) * W, and every
 * window is applied exactly once (parameters equal an uninterrupted run).
 */
class StageRestartTest {
    private val W = 2
    private fun initial() = linkedMapOf("a" to floatArrayOf(0.3f, -0.1f))
    private fun opt() = AdamW(lr = 1e-2)

    private companion object {
        fun grads(mb: Long): Map<String, FloatArray> = linkedMapOf("a" to floatArrayOf(0.1f * (mb + 1), -0.05f * mb))
        fun nValid(mb: Long): Int = (mb % 3 + 1).toInt()
    }

    /** Downstream: queue + trainer; upstream: its outbound link state. One "connection" at a time. */
    private class Downstream(val trainer: StageTrainer, val inflight: Int) {
        val queue = InboundQueue<Long>()
        val applied = ArrayList<Long>()
        var nextMb = trainer.nextMicroBatch
        fun greet(up: OutboundLinkState<Long>): String? {
            up.connected()
            val err = up.onReplayRequest(queue.nextAfter(nextMb))
            LinkRules.initialCredit(inflight, queue.size)?.let { up.onCredit(it) }
            return err
        }
        /** Deliver what the upstream may send, then train up to [stopAfter] micro-batches. */
        fun run(up: OutboundLinkState<Long>, stopAfter: Int) {
            var done = 0
            while (done < stopAfter) {
                generateSequence { up.takeNext() }.forEach { (mb, h) -> queue.put(mb, h) }
                val h = queue.tryTake(nextMb) ?: return
                up.onCredit(1)
                assertEquals(nextMb, h)
                applied.add(nextMb)
                if (trainer.onGradients(nextMb, grads(nextMb), nValid(nextMb)) == StageTrainer.Outcome.COMMITTED) {
                    up.onCommitted(trainer.lastCommittedWindow)
                }
                nextMb++; done++
            }
        }
    }

    @Test
    fun `restart replays exactly the gap and never applies a committed window twice`(@TempDir dir: File) {
        val up = OutboundLinkState<Long>("stage0-out", W, replayHorizon = 16)
        for (mb in 0L until 8L) up.publish(mb, mb)
        val f = File(dir, "ck.bin")
        val first = Downstream(StageTrainer(UpdateWindows(W), opt(), FileCheckpointStore(f), initial()), inflight = 2)
        assertNull(first.greet(up))
        first.run(up, stopAfter = 5) // windows 0 and 1 committed, micro-batch 4 accumulated, then a crash
        assertEquals(listOf(0L, 1L, 2L, 3L, 4L), first.applied)
        assertEquals(listOf(4L, 5L, 6L, 7L), up.buffered(), "windows 0-1 pruned on commit; 4.. kept for replay")
        up.disconnected()

        val second = Downstream(StageTrainer(UpdateWindows(W), opt(), FileCheckpointStore(f), initial()), inflight = 2)
        assertEquals(1, second.trainer.lastCommittedWindow)
        assertNull(second.greet(up), "the gap is still buffered")
        second.run(up, stopAfter = 100)
        assertEquals(listOf(4L, 5L, 6L, 7L), second.applied, "exactly the gap: 4 redone, nothing of windows 0-1")
        assertEquals(3, second.trainer.lastCommittedWindow)
        assertEquals(4, second.trainer.optimizerSteps, "4 windows, 4 AdamW steps")

        val ref = StageTrainer(UpdateWindows(W), opt(), MemoryCheckpointStore(), initial())
        for (mb in 0L until 8L) ref.onGradients(mb, grads(mb), nValid(mb))
        assertArrayEquals(ref.parameter("a"), second.trainer.parameter("a"), "same as an uninterrupted run")
    }

    @Test
    fun `a restart below what the upstream holds is reported, never skipped silently`() {
        val up = OutboundLinkState<Long>("stage0-out", W, replayHorizon = 16)
        for (mb in 0L until 6L) up.publish(mb, mb)
        up.connected(); up.onReplayRequest(0); up.onCredit(6)
        generateSequence { up.takeNext() }.toList()
        up.onCommitted(1) // windows 0 and 1 used durably: dropped
        up.disconnected(); up.connected()
        assertEquals(LinkRules.replayUnavailableMessage(2, 2L * W - 1, "stage0-out", 2L * W), up.onReplayRequest(2))
    }
}
