package org.zerolock.core.device

import org.zerolock.core.AdamW
import org.zerolock.core.FileCheckpointStore
import org.zerolock.core.InboundQueue
import org.zerolock.core.LossBatch
import org.zerolock.core.ProcStats
import org.zerolock.core.StageError
import org.zerolock.core.StageTrainer
import org.zerolock.core.Telemetry
import org.zerolock.core.TelemetryCounters
import org.zerolock.core.UpdateWindows
import org.zerolock.core.WindowTelemetry
import org.zerolock.core.protocol.ErrorCode
import org.zerolock.core.protocol.FrameWriter
import org.zerolock.core.protocol.Frames
import org.zerolock.core.protocol.Handshake
import org.zerolock.core.protocol.Message
import org.zerolock.core.protocol.Messages
import org.zerolock.core.protocol.MsgType
import org.zerolock.core.protocol.ProtocolException
import org.zerolock.core.protocol.Tensor
import java.io.File
import java.net.InetAddress
import java.security.MessageDigest

/**
 * The STAGE_ASSIGN parameters a stage runs with. The defaults, for keys an assignment leaves out,
 * are pinned by tests/vectors/stage_assign/stage_assign_defaults.json, which zl_mobile's StageConfig
 * passes too; zl-host sends every key but keep_checkpoints, so they decide nothing in its runs.
 */
class StageAssignment(val msg: Message) {
    val stage: Int = msg.long("stage").toInt()
    val numStages: Int = msg.long("num_stages").toInt()
    val upstream: String? = msg.stringOrNull("upstream")
    val downstream: String? = msg.stringOrNull("downstream")
    val programSha256: String = msg.string("program_sha256")
    val windowSize: Int = (msg.longOrNull("window_size") ?: 4L).toInt()
    val inflightDepth: Int = (msg.longOrNull("inflight_depth") ?: 2L).toInt()
    val replayHorizon: Int = (msg.longOrNull("replay_horizon") ?: 16L).toInt()
    /** listen_port: the inbound link's port; 0: any (the ACK says which). */
    val listenPort: Int = (msg.longOrNull("listen_port") ?: 0L).toInt()
    val upstreamToken: String? = msg.stringOrNull("upstream_token")
    val downstreamToken: String? = msg.stringOrNull("downstream_token")
    val runId: String = msg.stringOrNull("run_id") ?: "run"
    @Suppress("UNCHECKED_CAST")
    val config: Map<String, Any?> = msg.meta["config"] as? Map<String, Any?> ?: emptyMap()
    val lr: Double = (config["lr"] as? Number)?.toDouble() ?: 2e-3 // zl-host run's default
    val weightDecay: Double = (config["weight_decay"] as? Number)?.toDouble() ?: 0.0
    val totalMicroBatches: Long? = (config["total_micro_batches"] as? Number)?.toLong()
    /** config.alpha, the local loss weight; null: the export's ([ChunkRunner.alpha]). */
    val alpha: Double? = (config["alpha"] as? Number)?.toDouble()
    /** config.restart: start afresh even if this device runs the same run_id and stage. */
    val restart: Boolean = config["restart"] == true
    /** config.inject_failure: failures and slow phases injected for tests and benchmarks ([FaultInjector]). */
    val injectFailure: List<FailureSpec> = FailureSpec.listOf(config["inject_failure"])
    /** config.busy_ms: how long a stalled phase may keep this stage silent (HEARTBEAT busy_ms). */
    val busyMs: Long = (config["busy_ms"] as? Number)?.toLong() ?: 600_000L
    /** config.keep_checkpoints: this core keeps one window checkpoint per stage, and refuses more in [check]. */
    val keepCheckpoints: Long = (config["keep_checkpoints"] as? Number)?.toLong() ?: 1L
    /** config.rollback_to_window: the global-rollback baseline's restart point, which this core refuses in [check]. */
    val rollbackToWindow: Long? = (config["rollback_to_window"] as? Number)?.toLong()
    /** schedule: the pipeline schedule; this core runs only zerolock and refuses others in [check]. */
    val schedule: String = msg.stringOrNull("schedule") ?: "zerolock"

    fun check() {
        StageAssignRules.validate(msg.meta) // every field, before anything is created (PROTOCOL.md 5.3.1)
        // PROTOCOL.md 5.3.1: a refusal names its field first (`STAGE_ASSIGN <field>: ...`)
        fun reject(field: String, why: String): Nothing =
            throw ProtocolException(ErrorCode.REJECTED, "STAGE_ASSIGN $field: $why", msg.long("request_id"))
        if (windowSize < 1) reject("window_size", "must be >= 1")
        if (inflightDepth < 1) reject("inflight_depth", "must be >= 1")
        if (replayHorizon < 1) reject("replay_horizon", "must be >= 1")
        if (upstreamToken == null) {
            reject("upstream_token", "stage $stage lacks it: the stage needs the pairing token of its upstream link (section 6) to accept it")
        }
        if (downstream != null && downstreamToken == null) reject("downstream_token", "downstream $downstream given without it")
        // what this core cannot do is refused, never run as something else (kotlin_app/README.md)
        if (schedule != "zerolock") {
            reject("schedule", "$schedule: this phone's core runs only the zerolock schedule; run the BP baselines on zl-phone (--runtime python)")
        }
        val keep = keepCheckpoints
        if (keep > 1 || rollbackToWindow != null) {
            val field = if (keep > 1) "config.keep_checkpoints" else "config.rollback_to_window"
            reject(field, "global rollback (keep_checkpoints $keep, rollback_to_window $rollbackToWindow) is not supported: this phone's core keeps one " +
            "checkpoint per stage and recovers locally; use --recovery local, or zl-phone (--runtime python)")
        }
    }
}

/**
 * What the UI learns (the host gets the same records as TELEMETRY): [onTelemetry] after each
 * micro-batch (`kind` micro_batch), [onWindow] once per committed update window (`kind` window).
 */
fun interface StageListener {
    fun onTelemetry(t: Telemetry)
    fun onWindow(t: Telemetry) {}
}

/**
 * Device measurements: [sample] gives what the core cannot read itself (PSS, battery
 * temperature; the Android app asks the OS), [takePeakRssBytes] the peak RSS since its previous
 * call, then resets the mark (default: the kernel's VmHWM through /proc/self, Linux and Android;
 * null where unavailable, and the key is then left out of the TELEMETRY record).
 */
fun interface StatsProvider {
    fun sample(): Pair<Long, Double?>
    fun takePeakRssBytes(): Long? = ProcStats.SELF.takePeakRssBytes()
    /** The process's PSS before its first program was loaded (ManifestRunnerFactory reads it then). */
    fun runtimePssBytes(): Long? = ProcStats.SELF.runtimePssBytes()
    /** PSS of the mapped weights (.ptd); read once, after the first window. */
    fun weightsPssBytes(): Long? = ProcStats.SELF.pssWeightsBytes()
}

/**
 * One stage of the pipeline on this device, the Kotlin twin of zl_mobile/stage.py (ZeroLock
 * schedule): per micro-batch take h_{k-1} from the inbound queue (and return its credit), phase 1,
 * publish h_k downstream at once (early forwarding), phase 2, accumulate; at the end of each
 * update window AdamW, an atomic checkpoint, then CHECKPOINT_COMMITTED to the host and to the
 * upstream (which may then prune its replay buffer). TELEMETRY goes to the host as zl_mobile sends
 * it: a `micro_batch` record after each micro-batch's phase 2, and per window, after its
 * checkpoint and before CHECKPOINT_COMMITTED, a `window` record ([WindowTelemetry]). After a
 * restart the stage resumes at the
 * first micro-batch after its last committed window and says so in REPLAY_REQUEST, so no window
 * is lost or applied twice.
 */
class StageRuntime(
    val assignment: StageAssignment,
    private val runner: ChunkRunner,
    checkpointDir: File,
    private val hostOut: () -> FrameWriter?,
    private val stats: StatsProvider = StatsProvider { Pair(0L, null) },
    private val listener: StageListener = StageListener {},
    bind: InetAddress? = null,
    private val log: (String) -> Unit = {},
    /** The data port bound already by the device (a fixed listen_port, checked before the old stage stopped). */
    dataListener: java.net.ServerSocket? = null,
    /** An injected in-app failure dropped this stage (its detect: "connection" or "heartbeat"); the device reports it. */
    private val onFailure: (StageRuntime, String) -> Unit = { _, _ -> },
    /** The device sends no periodic heartbeat for this many ms (hold-gil-in-phase1, [FaultInjector]). */
    private val quiet: (Long) -> Unit = {},
    /** The device's link shaping (DeviceMain --rate-mbit, --link-delay-ms), as zl-phone's: outgoing paced, incoming delayed. */
    private val shaping: LinkShaping = LinkShaping(),
) {
    val windows = UpdateWindows(assignment.windowSize)
    private val checkpointFile = File(checkpointDir, "stage${assignment.stage}-${assignment.runId}.ckpt")
    /** Markers of fired failures live beside the checkpoints: a restarted stage replays without failing again. */
    private val faults = FaultInjector(assignment.injectFailure, checkpointDir, assignment.runId, assignment.stage, log)
    /** The window of the latest phase 1, the one a commit in progress belongs to. */
    @Volatile private var window = -1L
    private val store: FileCheckpointStore = FileCheckpointStore(checkpointFile) { point ->
        when (point) { // between the window's AdamW step and its durable checkpoint, as zl_mobile's hooks
            FileCheckpointStore.Point.BEFORE_WRITE -> faults.maybeFail(FaultInjector.BEFORE_COMMIT, window)
            FileCheckpointStore.Point.AFTER_TEMP_SYNCED -> faults.maybeFail(FaultInjector.MID_CHECKPOINT, window) { store.tearPending() }
            else -> {}
        }
    }
    val trainer = StageTrainer(windows, AdamW(lr = assignment.lr, weightDecay = assignment.weightDecay), store, runner.initialLora(),
        forwardOnly = assignment.lr == 0.0) // this core runs only the zerolock schedule (LR 0: a forward-only stage)

    /** The next micro-batch this stage trains: (last committed window + 1) * W after a (re)start. */
    @Volatile var nextMicroBatch: Long = trainer.nextMicroBatch
        private set
    val committedWindow: Long get() = trainer.lastCommittedWindow

    val queue = InboundQueue<Message>()
    /** What a peer may declare in a frame on either link: what this chunk's HIDDEN_STATE (or a
     *  GRADIENT) can need, as zl_mobile's Stage; more is OVERSIZED before anything is allocated. */
    val linkMaxFrame: Long = runner.linkElements?.let { org.zerolock.core.LinkRules.linkFrameLimit(it) } ?: Frames.DEFAULT_MAX_FRAME
    val inbound = InboundLink(
        "stage${assignment.stage}-in", assignment.upstreamToken!!, queue, assignment.inflightDepth,
        nextNeeded = { queue.nextAfter(nextMicroBatch) }, port = assignment.listenPort, bind = bind, log = log,
        listener = dataListener, maxFrame = linkMaxFrame, unusable = { m ->
            org.zerolock.core.LinkRules.unusable(m.long("micro_batch"), m.long("window"), nextMicroBatch,
                assignment.inflightDepth, assignment.windowSize, assignment.totalMicroBatches)
        }, delay = shaping.delay)
    val outbound: OutboundLink? = assignment.downstreamToken?.let { token ->
        OutboundLink("stage${assignment.stage}-out", token, assignment.windowSize, assignment.replayHorizon,
            onError = { reportError(it) }, log = log, maxFrame = linkMaxFrame,
            store = ReplayStore(File(checkpointDir, "stage${assignment.stage}-${assignment.runId}.replay")),
            firstMb = nextMicroBatch, limiter = shaping.limiter, delay = shaping.delay).also { it.setAddress(assignment.downstream) }
    }
    val dataPort: Int get() = inbound.port

    init {
        // a restarted stage re-announces its restored commit to each new upstream, as zl_mobile does
        if (trainer.lastCommittedWindow >= 0 && checkpointFile.isFile) {
            inbound.lastCommit = Message(MsgType.CHECKPOINT_COMMITTED, linkedMapOf("window" to trainer.lastCommittedWindow,
                "step" to trainer.optimizerSteps, "sha256" to Handshake.hex(MessageDigest.getInstance("SHA-256").digest(checkpointFile.readBytes()))))
        }
    }
    /** The program's input "alpha", [1] float32 as zl_mobile's Stage.alpha: config.alpha, else the export's. */
    private val alpha: Tensor? = (assignment.alpha ?: runner.alpha)?.let { Tensor.ofFloats(floatArrayOf(it.toFloat()), 1) }

    @Volatile private var running = true
    private var activeNs = 0L
    private var waitNs = 0L
    private val started = System.nanoTime()
    private val startedEpochS = System.currentTimeMillis() / 1e3
    /** The stage runs the ZeroLock schedule (phase 1, early forwarding, phase 2) whatever is assigned. */
    private val schedule = "zerolock"
    private val windowStats = WindowTelemetry(assignment.stage, schedule, counters(), forwardOnly = trainer.forwardOnly)
    /** The last `micro_batch` record. */
    @Volatile var lastTelemetry: Telemetry? = null
        private set
    /** The last `window` record. */
    @Volatile var lastWindowTelemetry: Telemetry? = null
        private set
    @Volatile var failure: Throwable? = null
        private set

    init {
        stats.takePeakRssBytes() // peaks count from here, not from loading
    }

    private val worker = Thread({ loop() }, "zl-stage-${assignment.stage}").also { it.isDaemon = true; it.start() }

    /** Seconds since the epoch at [nanoTime] (time.time() in zl_mobile), with nanoTime's resolution. */
    private fun epochS(nanoTime: Long): Double = startedEpochS + (nanoTime - started) / 1e9

    private fun counters(): TelemetryCounters = TelemetryCounters(activeNs / 1e9, waitNs / 1e9, epochS(System.nanoTime()),
        inbound.bytesReceived, outbound?.bytesSent ?: 0L)

    /** STAGE_ASSIGN for the running stage: only the downstream address changes. */
    fun rewire(downstream: String?) { outbound?.setAddress(downstream) }

    private fun loop() {
        while (running) {
            val total = assignment.totalMicroBatches
            if (total != null && nextMicroBatch >= total) { Thread.sleep(200); continue }
            // backpressure: wait for the downstream to commit before the next forward when the
            // replay buffer holds its bound (waiting, not compute)
            outbound?.let { waitNs += it.waitForRoom { !running } }
            val t0 = System.nanoTime()
            val mb = nextMicroBatch
            val m = queue.take(mb, 200)
            waitNs += System.nanoTime() - t0
            if (m == null) continue
            try {
                forward(mb, m)
            } catch (e: AppFailure) {
                dropState(e.detect)
                return
            } catch (e: Throwable) {
                failure = e
                reportError("stage ${assignment.stage} failed at micro-batch $mb: ${e.message ?: e}")
                running = false
            }
        }
    }

    private fun forward(mb: Long, m: Message) {
        nextMicroBatch = mb + 1 // before the credit goes out: the frame it allows is then in range
        inbound.grant(1, mb)
        val w = m.long("window")
        if (w != windows.windowOf(mb)) {
            throw StageError("bad_window", "micro-batch $mb labelled window $w, expected ${windows.windowOf(mb)} for window size ${windows.size}")
        }
        // before phase 1, as zl_mobile: a micro-batch the program cannot read whole fails the stage
        val batch = LossBatch.of(mb, m.tensors, runner.readoutRows)
        // in the batch as zl_mobile's Stage._batch: each phase takes it only if its inputs list it
        val tensors = if (alpha == null) batch.tensors else batch.tensors + ("alpha" to alpha)
        val lora = trainer.parameters()
        window = w
        val t0 = System.nanoTime()
        stallPhase1(w) // injected slowness counts as phase 1 time, as zl_mobile's
        val p1 = runner.phase1(tensors, lora)
        val t1 = System.nanoTime()
        activeNs += t1 - t0
        // early forwarding: h_k goes into the replay buffer and out as soon as a credit allows
        val hidden = Messages.hiddenState(mb, w, p1.h, m.tensors.filterKeys { it != "h" })
        outbound?.publish(hidden)
        outbound?.persist(hidden) // on disk too, for a restart of this stage (after it is handed to the sender)
        faults.maybeFail(FaultInjector.AFTER_PHASE1, w)
        val timing = linkedMapOf<String, Any?>("schedule" to schedule, "phase1_start" to epochS(t0), "phase1_end" to epochS(t1),
            "published" to epochS(System.nanoTime()))
        var taskLoss: Double? = null
        var consisLoss: Double? = null
        var loss: Double? = null
        var phase2Start: Long? = null
        var windowComplete = false
        if (trainer.forwardOnly && trainer.isTrainable(mb)) {
            // phase 1 and forwarding only: what phase 1 saved is dropped, the window still counts it
            windowComplete = trainer.accumulate(mb, emptyMap(), batch.valid) == StageTrainer.Outcome.WINDOW_COMPLETE
        } else if (trainer.isTrainable(mb)) {
            val t2 = System.nanoTime()
            phase2Start = t2
            val p2 = runner.phase2(tensors, p1, lora)
            windowComplete = trainer.accumulate(mb, p2.grads, batch.valid) == StageTrainer.Outcome.WINDOW_COMPLETE
            activeNs += System.nanoTime() - t2
            loss = p2.loss; taskLoss = p2.taskLoss; consisLoss = p2.consisLoss
        }
        val (pss, temp) = stats.sample() // after phase 2: near the resting level
        val peak = stats.takePeakRssBytes() // this micro-batch's peak, phases 1 and 2 included
        val end = System.nanoTime()
        if (phase2Start != null) {
            timing["phase2_start"] = epochS(phase2Start)
            timing["phase2_end"] = epochS(end)
            windowStats.add(w, epochS(t1) - epochS(t0), epochS(end) - epochS(phase2Start), loss, taskLoss, consisLoss, peak)
        } else if (trainer.forwardOnly && trainer.isTrainable(mb)) {
            windowStats.add(w, epochS(t1) - epochS(t0), 0.0, null, null, null, peak, phase2 = false)
        }
        val t = Telemetry(
            kind = Telemetry.MICRO_BATCH, stage = assignment.stage, window = w, step = trainer.optimizerSteps,
            taskLoss = taskLoss, consisLoss = consisLoss, pssBytes = pss, tempC = temp,
            activeS = activeNs / 1e9, waitS = waitNs / 1e9, loss = loss, microBatch = mb,
            timeMs = (end - started) / 1_000_000, rssPeakBytes = peak,
            bytesIn = inbound.bytesReceived, bytesOut = outbound?.bytesSent ?: 0L, extra = timing,
        )
        lastTelemetry = t
        listener.onTelemetry(t)
        hostOut()?.write(t.toMessage())
        if (windowComplete) endWindow()
    }

    /** The window's step and checkpoint, its `window` record, then CHECKPOINT_COMMITTED (host and upstream). */
    private fun endWindow() {
        val t0 = System.nanoTime()
        outbound?.sync() // the window's hidden states are durable before its commit covers them
        val cw = trainer.commitWindow()
        val sha = Handshake.hex(MessageDigest.getInstance("SHA-256").digest(checkpointFile.readBytes()))
        val stepNs = System.nanoTime() - t0
        activeNs += stepNs
        val (pss, temp) = stats.sample()
        windowStats.close(cw, trainer.optimizerSteps, stepNs / 1e9, counters(), pss, temp, stats.takePeakRssBytes(), memoryBreakdown())?.let { wt ->
            lastWindowTelemetry = wt
            listener.onWindow(wt)
            hostOut()?.write(wt.toMessage())
        }
        hostOut()?.write(Message(MsgType.CHECKPOINT_COMMITTED, linkedMapOf(
            "window" to cw, "step" to trainer.optimizerSteps, "sha256" to sha, "stage" to assignment.stage)))
        inbound.committed(cw, trainer.optimizerSteps, sha)
    }

    /** slow-phase1 and hold-gil-in-phase1 ([FaultInjector]) for this window's phase 1. */
    private fun stallPhase1(w: Long) {
        val slow = faults.slowSeconds(w)
        if (slow > 0) Thread.sleep((slow * 1000).toLong())
        val hold = faults.stallSeconds(w) ?: return
        val ms = (hold * 1000).toLong()
        // what zl_mobile's stage says before each runtime call, then silence: no heartbeat for `hold` s
        hostOut()?.write(Message(MsgType.HEARTBEAT, linkedMapOf("seq" to 0L, "busy_ms" to assignment.busyMs)))
        quiet(ms)
        Thread.sleep(ms)
        hostOut()?.write(Message(MsgType.HEARTBEAT, linkedMapOf("seq" to 0L, "busy_ms" to 0L)))
    }

    /**
     * An injected in-app failure (mode "app"), as zl_mobile's Stage._drop_state: the stage thread
     * ends, its links close (the upstream and downstream see the connections drop), its program is
     * released and its memory (LoRA, AdamW moments, window gradients) goes with this object; only
     * what it committed to disk remains. The device then drops it and tells the host ([onFailure]);
     * a new STAGE_ASSIGN restores the stage from its checkpoint and the upstream's replay.
     */
    private fun dropState(detect: String) {
        log("stage ${assignment.stage}: dropped its state inside the running phone (in-app failure, detected by $detect)")
        dropped = true
        running = false
        queue.stop()
        inbound.close()
        outbound?.close()
        runner.close()
        onFailure(this, detect)
    }

    private var weightsPss: Long? = null
    private var weightsRead = false

    /** The window record's memory breakdown, as zl_mobile sends it: readings not made are left out. */
    private fun memoryBreakdown(): Map<String, Long> {
        if (!weightsRead) { // smaps is long: read once, after the first window (the weights are touched by then)
            weightsPss = stats.weightsPssBytes()?.takeIf { it > 0 }
            weightsRead = true
        }
        val m = LinkedHashMap<String, Long>()
        stats.runtimePssBytes()?.let { m["pss_runtime_bytes"] = it }
        weightsPss?.let { m["pss_weights_bytes"] = it }
        return m
    }

    /** To the host as ERROR REJECTED, fatal (as zl_mobile does): a lost replay, a failed micro-batch. */
    private fun reportError(text: String) {
        log(text)
        hostOut()?.let { out -> try { out.write(Messages.error(ErrorCode.REJECTED, text, fatal = true)) } catch (_: Exception) {} }
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
        meta["committed_window"] = trainer.lastCommittedWindow
        return Message(MsgType.STATE_PUT, meta, tensors)
    }

    @Volatile private var dropped = false

    fun stop() {
        if (dropped) return // dropState closed everything already
        running = false
        queue.stop()
        if (Thread.currentThread() !== worker) worker.join(2000)
        inbound.close()
        outbound?.close()
        runner.close()
    }
}
