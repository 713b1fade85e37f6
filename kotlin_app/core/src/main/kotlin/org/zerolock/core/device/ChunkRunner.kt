package org.zerolock.core.device

import org.zerolock.core.Json
import org.zerolock.core.asObject
import org.zerolock.core.protocol.DType
import org.zerolock.core.protocol.Tensor
import org.zerolock.core.str

/** Result of phase 2: the local loss, its two terms, and one gradient per LoRA tensor. */
class Phase2Result(val loss: Double, val taskLoss: Double, val consisLoss: Double, val grads: Map<String, FloatArray>)

/**
 * Output of phase 1: h_k (sent downstream at once) and what phase 2 needs: [saved] as tensors,
 * [kept] left in a [ChainingBackend]'s memory (by name), read by phase 2 without a copy.
 */
class Phase1Result(val h: Tensor, val saved: Map<String, Tensor>, val kept: Map<String, MethodInput.Kept> = emptyMap())

/**
 * What a stage runs per micro-batch. The Android app implements it with ExecuTorch (through
 * [ManifestChunkRunner] + a [MethodBackend]); tests and DeviceMain use [AffineChunkRunner].
 */
interface ChunkRunner {
    /** LoRA tensor names (in the program's input order) and shapes. */
    val loraShapes: LinkedHashMap<String, LongArray>
    /**
     * The program's readout rows (manifest `export.readout_rows`): the stage gathers each
     * micro-batch's valid positions into them ([org.zerolock.core.LossBatch]). null: no readout.
     */
    val readoutRows: Int? get() = null
    /**
     * The manifest's `export.alpha` (local loss alpha*CE + (1-alpha)*KL): the stage feeds it as
     * input "alpha" unless STAGE_ASSIGN's config.alpha overrides it. null: none.
     */
    val alpha: Double? get() = null
    /**
     * Elements of the tensors a stage link carries for this chunk, as zl_mobile's
     * Stage._link_elements: its data inputs (h or token ids, masks, positions; not the LoRA
     * weights) plus its output h. The stage bounds both links' frames by
     * [org.zerolock.core.LinkRules.linkFrameLimit] of it. null: unknown (the default limit).
     */
    val linkElements: Long? get() = null
    fun initialLora(): Map<String, FloatArray>
    /** [batch]: the HIDDEN_STATE tensors ("h" = h_{k-1}, plus labels/mask...), loss_index/target/weight and alpha. */
    fun phase1(batch: Map<String, Tensor>, lora: Map<String, FloatArray>): Phase1Result
    fun phase2(batch: Map<String, Tensor>, p1: Phase1Result, lora: Map<String, FloatArray>): Phase2Result
    fun close() {}
}

/**
 * Runs one method of a loaded program: inputs and outputs in signature order. [outputNames] are
 * the manifest's names of the outputs, in order (a backend that gets some outputs by name, like
 * ExecuTorch's TrainingModule with its named gradients, puts them back in this order).
 */
interface MethodBackend {
    fun run(method: String, inputs: List<Tensor>, outputNames: List<String>): List<Tensor>
    fun close() {}
}

/** One input of [ChainingBackend.runKeeping]: a tensor, or an output a previous run kept. */
sealed class MethodInput {
    class Value(val tensor: Tensor) : MethodInput()
    /** Output [index] of run [generation] of [method], still in the backend's memory. */
    class Kept(val method: String, val index: Int, val generation: Long) : MethodInput()
}

/**
 * A backend that can leave outputs in its own memory for a later method: phase 1's saved
 * activations (most of a micro-batch's bytes: ~100 MB for a SmolLM2 chunk) go to phase 2 without
 * a copy into and out of the JVM heap. A kept output lives until its method runs again.
 */
interface ChainingBackend : MethodBackend {
    class Outputs(val generation: Long, val tensors: List<Tensor?>)
    /** Runs [method]; output i with [keep] set stays in the backend (null in the result). */
    fun runKeeping(method: String, inputs: List<MethodInput>, outputNames: List<String>, keep: BooleanArray): Outputs
}

/**
 * A chunk described by its entry in zl-export's manifest.json (`chunks[k]`): `methods.phase1` /
 * `methods.phase2` give input and output names (and input shapes/dtypes), `lora` the adapter
 * tensors. Inputs are matched by name: LoRA tensors from the adapter, the chunk's `first_input`
 * ("h_in", or "input_ids" for chunk 0) from the HIDDEN_STATE tensor "h", any other from the micro-batch's tensors of that name (loss_index /
 * loss_target / loss_weight: the readout the stage gathered into [readoutRows]; alpha: the loss
 * weight the stage resolved from config.alpha or [alpha]), and phase-2
 * inputs also from phase 1's outputs. Phase 1 outputs "h_out" first; phase 2 outputs
 * "loss", "task_loss", "consis_loss", then "grad:<lora name>" per LoRA tensor.
 */
class ManifestChunkRunner(
    private val chunk: Map<String, Any?>,
    private val backend: MethodBackend,
    override val readoutRows: Int? = null,
    override val alpha: Double? = null,
    /** The model's vocabulary (manifest `model.config.vocab_size`): token ids are checked against it. */
    private val vocabSize: Long? = null,
    /** The export's LoRA initialisation (the chunk's `lora_init` file), else [initialLora] draws one. */
    private val loraInit: Map<String, FloatArray>? = null,
) : ChunkRunner {
    class Spec(val name: String, val shape: LongArray?, val dtype: String?)

    private val methods = chunk["methods"].asObject("manifest chunk 'methods'")
    private fun specs(method: String, key: String): List<Spec> {
        @Suppress("UNCHECKED_CAST")
        val l = methods[method].asObject("method $method")[key] as? List<Any?> ?: throw Json.JsonError("method $method lacks '$key'")
        return l.map { e ->
            val o = e.asObject("$method $key entry")
            @Suppress("UNCHECKED_CAST")
            Spec(o.str("name"), (o["shape"] as? List<Number>)?.map { it.toLong() }?.toLongArray(), o["dtype"] as? String)
        }
    }

    private val p1In = specs("phase1", "inputs")
    private val p1Out = specs("phase1", "outputs")
    private val p2In = specs("phase2", "inputs")
    private val p2Out = specs("phase2", "outputs")

    override val loraShapes: LinkedHashMap<String, LongArray> = LinkedHashMap<String, LongArray>().also { m ->
        @Suppress("UNCHECKED_CAST")
        for (e in chunk["lora"] as? List<Any?> ?: throw Json.JsonError("manifest chunk lacks 'lora'")) {
            val o = e.asObject("lora entry")
            @Suppress("UNCHECKED_CAST")
            m[o.str("name")] = (o["shape"] as List<Number>).map { it.toLong() }.toLongArray()
        }
    }

    /** LoRA init as PEFT does it: A small random (Kaiming-uniform like), B zero. */
    override fun initialLora(): Map<String, FloatArray> {
        loraInit?.let { init ->
            return loraShapes.mapValues { (name, shape) ->
                val v = init[name] ?: throw IllegalArgumentException("the export's lora_init has no tensor $name: re-export the chunk")
                require(v.size.toLong() == shape.fold(1L) { a, b -> a * b }) { "lora_init's $name has ${v.size} values, the program takes ${shape.toList()}" }
                v.copyOf()
            }
        }
        val rnd = java.util.Random(0)
        return loraShapes.mapValues { (name, shape) ->
            val n = shape.fold(1L) { a, b -> a * b }.toInt()
            if (name.contains("lora_B")) FloatArray(n) else {
                val fanIn = shape.last().toDouble()
                val bound = Math.sqrt(1.0 / fanIn)
                FloatArray(n) { ((rnd.nextDouble() * 2 - 1) * bound).toFloat() }
            }
        }
    }

    /** Every phase-1 input but the LoRA tensors, plus h_out (null if the manifest omits a shape). */
    override val linkElements: Long? = run {
        val shapes = p1In.filter { it.name !in loraShapes }.map { it.shape } + p1Out.take(1).map { it.shape }
        if (shapes.any { it == null }) null else shapes.sumOf { s -> s!!.fold(1L) { a, b -> a * b } }
    }

    private val phase2Names = p2In.map { it.name }.toSet()
    /** The input HIDDEN_STATE's "h" feeds: h_in, or input_ids for the first chunk (manifest `first_input`). */
    private val firstInput = chunk["first_input"] as? String ?: "h_in"

    /** Each input of [method] by name: a LoRA tensor, a tensor of [pool], or an output [kept] by the backend. */
    private fun gather(method: String, specs: List<Spec>, pool: Map<String, Tensor>, lora: Map<String, FloatArray>,
                       kept: Map<String, MethodInput.Kept> = emptyMap()): List<MethodInput> =
        specs.map { s ->
            kept[s.name]?.takeIf { s.name !in lora && s.name !in pool }?.let { return@map it }
            val t = lora[s.name]?.let { Tensor.ofFloats(it, *loraShapes[s.name]!!) }
                ?: pool[s.name]
                ?: (if (s.name == firstInput) pool["h"] else null)
                ?: throw IllegalArgumentException("$method needs input '${s.name}', which the micro-batch does not carry")
            if (s.shape != null && !s.shape.contentEquals(t.shape)) {
                throw IllegalArgumentException("$method input '${s.name}' has shape ${t.shape.toList()}, the program was exported for ${s.shape.toList()}: pad the micro-batch or re-export")
            }
            if (s.dtype != null && s.dtype != t.dtype.wireName) {
                throw IllegalArgumentException("$method input '${s.name}' is ${t.dtype.wireName}, the program takes ${s.dtype}")
            }
            if (s.name == "input_ids" && vocabSize != null) checkTokenIds(t, vocabSize)
            MethodInput.Value(t)
        }

    /** The embedding kernel does not check its ids: an id outside the vocabulary would read past the table. */
    private fun checkTokenIds(t: Tensor, vocab: Long) {
        val ids = t.toLongArray()
        val bad = ids.indexOfFirst { it < 0 || it >= vocab }
        if (bad >= 0) throw IllegalArgumentException("input_ids holds token id ${ids[bad]} (position $bad), outside the model's vocabulary 0..${vocab - 1}: tokenize with the export's tokenizer")
    }

    private fun call(method: String, inputs: List<MethodInput>, names: List<String>, keep: BooleanArray? = null): ChainingBackend.Outputs {
        val b = backend
        if (b is ChainingBackend) return b.runKeeping(method, inputs, names, keep ?: BooleanArray(names.size))
        // a plain backend: every input is a tensor (nothing was kept)
        return ChainingBackend.Outputs(0, b.run(method, inputs.map { (it as MethodInput.Value).tensor }, names))
    }

    override fun phase1(batch: Map<String, Tensor>, lora: Map<String, FloatArray>): Phase1Result {
        val names = p1Out.map { it.name }
        // what only phase 2 reads stays in the backend's memory; h_out is sent downstream
        val keep = BooleanArray(names.size) { names[it] != "h_out" && names[it] in phase2Names }
        val r = call("phase1", gather("phase1", p1In, batch, lora), names, keep)
        val outs = r.tensors
        require(outs.size == p1Out.size) { "phase1 returned ${outs.size} outputs, manifest lists ${p1Out.size}" }
        val named = LinkedHashMap<String, Tensor>()
        val kept = LinkedHashMap<String, MethodInput.Kept>()
        for ((i, s) in p1Out.withIndex()) {
            val t = outs[i]
            if (t != null) named[s.name] = t else kept[s.name] = MethodInput.Kept("phase1", i, r.generation)
        }
        val h = named["h_out"] ?: outs[0] ?: throw IllegalStateException("phase1 returned no h_out")
        return Phase1Result(h, named, kept)
    }

    override fun phase2(batch: Map<String, Tensor>, p1: Phase1Result, lora: Map<String, FloatArray>): Phase2Result {
        val pool = LinkedHashMap<String, Tensor>(batch).also { it.putAll(p1.saved) }
        val outs = call("phase2", gather("phase2", p2In, pool, lora, p1.kept), p2Out.map { it.name }).tensors
        require(outs.size == p2Out.size) { "phase2 returned ${outs.size} outputs, manifest lists ${p2Out.size}" }
        val named = p2Out.map { it.name }.zip(outs).toMap()
        fun scalar(n: String): Double = named[n]?.toFloatArray()?.firstOrNull()?.toDouble() ?: Double.NaN
        val grads = LinkedHashMap<String, FloatArray>()
        for (n in loraShapes.keys) grads[n] = named["grad:$n"]?.toFloatArray() ?: throw IllegalStateException("phase2 returned no gradient for $n")
        return Phase2Result(scalar("loss"), scalar("task_loss"), scalar("consis_loss"), grads)
    }

    override fun close() = backend.close()

    companion object {
        /** Whether either phase of [chunk] lists an input named [name] (checked before the program is loaded). */
        fun takesInput(chunk: Map<String, Any?>, name: String): Boolean =
            listOf("phase1", "phase2").any { m ->
                val inputs = ((chunk["methods"] as? Map<*, *>)?.get(m) as? Map<*, *>)?.get("inputs") as? List<*>
                inputs?.any { (it as? Map<*, *>)?.get("name") == name } == true
            }
    }
}

/**
 * A stand-in chunk for tests and the interop demo: h_k = h * (1 + a) + b elementwise with two
 * scalar "LoRA" parameters a, b, and the loss 0.5 * mean((h_k - target)^2) with target 0.
 * Gradients are exact, so training visibly lowers the loss.
 */
class AffineChunkRunner(
    /** What its links may carry ([ChunkRunner.linkElements]); tests set it to bound the links' frames. */
    override val linkElements: Long? = null,
) : ChunkRunner {
    override val loraShapes = linkedMapOf("a" to longArrayOf(1), "b" to longArrayOf(1))
    override fun initialLora(): Map<String, FloatArray> = linkedMapOf("a" to floatArrayOf(0f), "b" to floatArrayOf(0.5f))

    override fun phase1(batch: Map<String, Tensor>, lora: Map<String, FloatArray>): Phase1Result {
        val hIn = batch["h"] ?: throw IllegalArgumentException("HIDDEN_STATE lacks 'h'")
        require(hIn.dtype == DType.FLOAT32 || hIn.dtype == DType.BFLOAT16 || hIn.dtype == DType.FLOAT16) { "h must be a float tensor" }
        val x = hIn.toFloatArray()
        val a = lora["a"]!![0]; val b = lora["b"]!![0]
        val y = FloatArray(x.size) { x[it] * (1f + a) + b }
        return Phase1Result(Tensor.ofFloats(y, *hIn.shape), mapOf("x" to Tensor.ofFloats(x, *hIn.shape)))
    }

    override fun phase2(batch: Map<String, Tensor>, p1: Phase1Result, lora: Map<String, FloatArray>): Phase2Result {
        val x = p1.saved["x"]!!.toFloatArray()
        val y = p1.h.toFloatArray()
        val n = maxOf(1, y.size)
        var loss = 0.0; var ga = 0.0; var gb = 0.0
        for (i in y.indices) { loss += 0.5 * y[i] * y[i]; ga += y[i] * x[i]; gb += y[i] }
        return Phase2Result(loss / n, loss / n, 0.0, linkedMapOf("a" to floatArrayOf((ga / n).toFloat()), "b" to floatArrayOf((gb / n).toFloat())))
    }
}
