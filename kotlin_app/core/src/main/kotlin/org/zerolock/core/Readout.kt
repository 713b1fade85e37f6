package org.zerolock.core

import org.zerolock.core.protocol.DType
import org.zerolock.core.protocol.Tensor

/**
 * A micro-batch's valid positions (labels != -100, labels already shifted) gathered in row-major
 * order into a program's [capacity] readout rows (PROTOCOL.md 5.4.2), as zl_mobile/readout.py:
 * `index` b*S+i, `target` the label, `weight` 1; unused slots 0, 0, 0. [valid] is n_i.
 */
class Readout(val index: LongArray, val target: LongArray, val weight: FloatArray, val valid: Int) {
    val capacity: Int get() = index.size

    /** The program's loss inputs. */
    fun tensors(): Map<String, Tensor> = linkedMapOf(
        "loss_index" to Tensor.ofLongs(index, index.size.toLong()),
        "loss_target" to Tensor.ofLongs(target, target.size.toLong()),
        "loss_weight" to Tensor.ofFloats(weight, weight.size.toLong()))

    companion object {
        const val IGNORE_INDEX = -100L

        fun labelsOf(t: Tensor): LongArray {
            if (t.dtype != DType.INT64 && t.dtype != DType.INT32 && t.dtype != DType.UINT8) {
                throw StageError("bad_labels", "labels must be an integer tensor, got ${t.dtype.wireName}")
            }
            return t.toLongArray()
        }

        fun countValid(labels: LongArray): Int = labels.count { it != IGNORE_INDEX }

        /**
         * Never cuts: more valid positions than [capacity] fails micro-batch [microBatch] with
         * zl_mobile's message (the host checks this before a run; a stage sent one anyway must
         * not train on part of it).
         */
        fun gather(labels: LongArray, capacity: Int, microBatch: Long): Readout {
            require(capacity >= 0) { "capacity must be >= 0, got $capacity" }
            val n = countValid(labels)
            if (n > capacity) {
                throw StageError("loss_positions", "micro-batch $microBatch has $n valid positions, more than the program's " +
                    "$capacity; re-export with zl-export --loss-positions $n or more")
            }
            val index = LongArray(capacity); val target = LongArray(capacity); val weight = FloatArray(capacity)
            var j = 0
            for (i in labels.indices) if (labels[i] != IGNORE_INDEX) { index[j] = i.toLong(); target[j] = labels[i]; weight[j] = 1f; j++ }
            return Readout(index, target, weight, n)
        }
    }
}

/** A micro-batch as the chunk reads it (HIDDEN_STATE tensors, plus the loss inputs) and its n_i. */
class LossBatch(val tensors: Map<String, Tensor>, val valid: Int) {
    companion object {
        /**
         * [readoutRows]: the program's (manifest `export.readout_rows`); it needs `labels` and gets
         * loss_index / loss_target / loss_weight. null: a chunk without readout rows (the
         * [org.zerolock.core.device.AffineChunkRunner] stand-in): n_i counts the labels, or, when
         * the micro-batch carries none, every row of h (its loss covers them all).
         */
        fun of(microBatch: Long, tensors: Map<String, Tensor>, readoutRows: Int?): LossBatch {
            val labels = tensors["labels"]?.let { Readout.labelsOf(it) }
            if (readoutRows == null) {
                val n = labels?.let { Readout.countValid(it) } ?: tensors["h"]?.let { h ->
                    if (h.shape.isEmpty()) 1 else (h.elementCount / maxOf(1L, h.shape.last())).toInt()
                } ?: 0
                return LossBatch(tensors, n)
            }
            labels ?: throw StageError("no_labels", "micro-batch $microBatch carries no labels: the program reads its loss positions from them")
            val r = Readout.gather(labels, readoutRows, microBatch)
            return LossBatch(LinkedHashMap(tensors).also { it.putAll(r.tensors()) }, r.valid)
        }
    }
}
