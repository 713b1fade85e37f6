package org.zerolock.core.device

import org.zerolock.core.AdamW
import org.zerolock.core.CreditGate
import org.zerolock.core.FileCheckpointStore
import org.zerolock.core.InboundBuffer
import org.zerolock.core.StageError
import org.zerolock.core.StageTrainer
import org.zerolock.core.Telemetry
import org.zerolock.core.UpdateWindows
import org.zerolock.core.protocol.ErrorCode
import org.zerolock.core.protocol.FrameWriter
import org.zerolock.core.protocol.Handshake
import org.zerolock.core.protocol.Message
import org.zerolock.core.protocol.Messages
import org.zerolock.core.protocol.MsgType
import org.zerolock.core.protocol.ProtocolException
import org.zerolock.core.protocol.Tensor
import java.io.File
import java.security.MessageDigest
import java.util.concurrent.LinkedBlockingQueue
import java.util.concurrent.TimeUnit

/** The STAGE_ASSIGN parameters a stage runs with (defaults when the host omits them). */
class StageAssignment(val msg: Message) {
    val stage: Int = msg.long("stage").toInt()
    val numStages: Int = msg.long("num_stages").toInt()
    val upstream: String? = msg.stringOrNull("upstream")
    val downstream: String? = msg.stringOrNull("downstream")
    val programSha256: String = msg.string("program_sha256")
    val windowSize: Int = (msg.longOrNull("window_size") ?: 4L).toInt()
    val inflightDepth: Int = (msg.longOrNull("inflight_depth") ?: 2L).toInt()
    val bufferCapacity: Int = (msg.longOrNull("buffer_capacity") ?: (windowSize + inflightDepth).toLong()).toInt()
    val listenPort: Int? = msg.longOrNull("listen_port")?.toInt()
    val upstreamToken: String? = msg.stringOrNull("upstream_token")
    val downstreamToken: String? = msg.stringOrNull("downstream_token")
    val runId: String = msg.stringOrNull("run_id") ?: "run"
    @Suppress("UNCHECKED_CAST")
    val config: Map<String, Any?> = msg.meta["config"] as? Map<String, Any?> ?: emptyMap()
    val lr: Double = (config["lr"] as? Number)?.toDouble() ?: 2e-4
    val weightDecay: Double = (config["weight_decay"] as? Number)?.toDouble() ?: 0.0

    fun check() {
        fun reject(why: String): Nothing = throw ProtocolException(ErrorCode.REJECTED, why, msg.long("request_id"))
        if (windowSize < 1) reject("window_size must be >= 1")
        if (inflightDepth < 1) reject("inflight_depth must be >= 1")
        // processed entries stay buffered until their window commits (<= W-1) + D in flight
        if (bufferCapacity < windowSize - 1 + inflightDepth) {
            reject("buffer_capacity $bufferCapacity < window_size - 1 + inflight_depth = ${windowSize - 1 + inflightDepth}: the upstream could overflow it")
        }
        if (downstream != null && downstreamToken == null) reject("downstream $downstream given without downstream_token")
    }
}

/** Where h_k goes: a downstream link, the sender itself (demo/echo mode), or nowhere (last stage). */
interface HiddenSink {
    /** Blocks until a credit is available, then sends. */
    fun send(m: Message)
    fun onCredit(n: Int) {}
    fun close() {}
}

/** What the UI (and the host, as TELEMETRY) learns after each micro-batch. */
fun interface StageListener { fun onTelemetry(t: Telemetry) }

/** Device measurements the core cannot make itself (PSS, battery temperature). */
fun interface StatsProvider { fun sample(): Pair<Long, Double?> }

/**
 * One stage of the pipeline on this device: inbound buffer, credits, the trainer and its
 * checkpoint, and a worker thread that runs phase 1 -> send h_k -> phase 2 -> accumulate/step.
 */
class StageRuntime(
    val assignment: StageAssignment,
    private val runner: ChunkRunner,
    checkpointDir: File,
    private val sink: HiddenSink?,
    private val hostOut: () -> FrameWriter?,
    private val stats: StatsProvider = StatsProvider { Pair(0L, null) },
    private val listener: StageListener = StageListener {},
) {
    val windows = UpdateWindows(assignment.windowSize)
    val buffer = InboundBuffer<Message>(assignment.bufferCapacity)
    private val checkpointFile = File(checkpointDir, "stage${assignment.stage}-${assignment.runId}.ckpt")
    val trainer = StageTrainer(windows, AdamW(lr = assignment.lr, weightDecay = assignment.weightDecay), FileCheckpointStore(checkpointFile), runner.initialLora())

    private class Work(val mb: Long, val replyTo: FrameWriter?)
    private val queue = LinkedBlockingQueue<Work>()
    @Volatile private var running = true
    private var forwardedUpTo = -1L
    private var activeNs = 0L
    private var waitNs = 0L
    private val started = System.nanoTime()
    @Volatile var lastTelemetry: Telemetry? = null
        private set
    @Volatile var failure: Throwable? = null
        private set

    private val worker = Thread({ loop() }, "zl-stage-${assignment.stage}").also { it.isDaemon = true; it.start() }

    /** HIDDEN_STATE from upstream (the host for stage 0). Errors are ProtocolExceptions. */
    @Synchronized
    fun onHidden(m: Message, replyTo: FrameWriter?) {
        val mb = m.long("micro_batch")
        val accepted = try {
            buffer.push(mb, m)
        } catch (e: StageError) {
            throw ProtocolException(ErrorCode.UNEXPECTED, "${e.message}; the upstream must respect its credits")
        }
        if (!accepted) { replyTo?.write(Messages.credit(1, mb)); return } // below the horizon: drop, return the credit
        queue.put(Work(mb, replyTo))
    }

    /** REPLAY_REQUEST: reprocess buffered micro-batches [from, to] (after a restart). */
    @Synchronized
    fun replay(from: Long, to: Long) {
        trainer.restore()
        for ((mb, _) in buffer.replayFrom(from)) if (mb <= to) queue.put(Work(mb, null))
    }

    private fun loop() {
        while (running) {
            val t0 = System.nanoTime()
            val w = queue.poll(200, TimeUnit.MILLISECONDS) ?: continue
            waitNs += System.nanoTime() - t0
            try {
                process(w)
            } catch (e: Throwable) {
                failure = e
                hostOut()?.let { out -> try { out.write(Messages.error(ErrorCode.INTERNAL, "stage ${assignment.stage}: ${e.message ?: e}")) } catch (_: Exception) {} }
                running = false
            }
        }
    }

    private fun process(w: Work) {
        val m = synchronized(this) { buffer[w.mb] } ?: return // pruned meanwhile
        val t0 = System.nanoTime()
        val lora = trainer.parameters()
        val p1 = runner.phase1(m.tensors, lora)
        activeNs += System.nanoTime() - t0
        if (w.mb > forwardedUpTo && sink != null) {
            val others = m.tensors.filterKeys { it != "h" }
            val t1 = System.nanoTime()
            sink.send(Messages.hiddenState(w.mb, m.long("window"), p1.h, others)) // early forwarding
            waitNs += System.nanoTime() - t1
        }
        forwardedUpTo = maxOf(forwardedUpTo, w.mb)
        w.replyTo?.write(Messages.credit(1, w.mb))
        var taskLoss: Double? = null
        var consisLoss: Double? = null
        var loss: Double? = null
        if (trainer.isTrainable(w.mb)) {
            val t2 = System.nanoTime()
            val p2 = runner.phase2(m.tensors, p1, lora)
            val outcome = trainer.onGradients(w.mb, p2.grads)
            activeNs += System.nanoTime() - t2
            loss = p2.loss; taskLoss = p2.taskLoss; consisLoss = p2.consisLoss
            if (outcome == StageTrainer.Outcome.COMMITTED) {
                synchronized(this) { buffer.setHorizon(windows.firstOf(trainer.lastCommittedWindow + 1)) }
                val sha = Handshake.hex(MessageDigest.getInstance("SHA-256").digest(checkpointFile.readBytes()))
                hostOut()?.write(Message(MsgType.CHECKPOINT_COMMITTED, linkedMapOf(
                    "window" to trainer.lastCommittedWindow, "step" to trainer.optimizerSteps, "sha256" to sha)))
            }
        }
        val (pss, temp) = stats.sample()
        val t = Telemetry(
            stage = assignment.stage, window = windows.windowOf(w.mb), step = trainer.optimizerSteps,
            taskLoss = taskLoss, consisLoss = consisLoss, pssBytes = pss, tempC = temp,
            activeS = activeNs / 1e9, waitS = waitNs / 1e9, loss = loss, microBatch = w.mb,
            timeMs = (System.nanoTime() - started) / 1_000_000,
        )
        lastTelemetry = t
        listener.onTelemetry(t)
        hostOut()?.write(t.toMessage())
    }

    /** STATE_GET: the adapter ("lora") or AdamW moments ("optimizer") as tensors. */
    fun state(kind: String, requestId: Long): Message {
        val tensors = LinkedHashMap<String, Tensor>()
        for ((name, shape) in runner.loraShapes) {
            if (kind == "lora") tensors[name] = Tensor.ofFloats(trainer.parameter(name), *shape)
            else {
                val s = trainer.optimizerState(name)
                tensors["exp_avg/$name"] = Tensor.ofFloats(s.expAvg, *shape)
                tensors["exp_avg_sq/$name"] = Tensor.ofFloats(s.expAvgSq, *shape)
            }
        }
        val meta = linkedMapOf<String, Any?>("request_id" to requestId, "kind" to kind, "step" to trainer.optimizerSteps)
        if (trainer.lastCommittedWindow >= 0) meta["window"] = trainer.lastCommittedWindow
        return Message(MsgType.STATE_PUT, meta, tensors)
    }

    fun stop() {
        running = false
        worker.join(2000)
        sink?.close()
        runner.close()
    }
}
