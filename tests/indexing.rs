//! Lookups and scatters at sizes a model uses: an embedding from a 32,000-row table (ids out of
//! range included) and its gradient, a `gather` and a `scatter_add` with many indices naming
//! one element, each checked against the f64 reference interpreter; a scatter-add's sums give
//! the same bits at 1 and N threads; a lookup costs one kernel whatever the table's size; and a
//! cross-entropy's targets in and out of range give the loss its docs define. Each
//! case runs with i64 and i32 indices where the device holds them (wgpu: i32 only).
//! (`tests/properties.rs` checks the indexing ops in random programs; this file pins the large
//! cases a reader wants to see.)

mod common;

use braid::prelude::*;
use common::check_recorded;

/// The index dtypes `dev` holds, i64 first: the indexing ops take i64 and i32 indices on every
/// device that holds them (wgpu holds i32 only).
fn index_dtypes(dev: &Device) -> Vec<DType> {
    [DType::I64, DType::I32].into_iter().filter(|&d| dev.target().dtypes.contains(d)).collect()
}

/// `values` as an index tensor of `dtype` (i64 or i32).
fn index(values: Vec<i64>, shape: impl Into<Shape>, dtype: DType, dev: &Device) -> Tensor {
    match dtype {
        DType::I64 => Tensor::from_vec(values, shape, dev),
        _ => Tensor::from_vec(values.into_iter().map(|v| v as i32).collect::<Vec<_>>(), shape, dev),
    }
}

/// `n` pseudo-random ids in `-2..vocabulary + 2` (a few out of range on both sides).
fn ids(n: usize, vocabulary: usize, seed: u64) -> Vec<i64> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 33) % (vocabulary as u64 + 4)) as i64 - 2
        })
        .collect()
}

#[test]
fn an_embedding_from_a_large_table_and_its_gradient_match_the_reference() {
    let dev = braid::testing::test_device();
    for dtype in index_dtypes(&dev) {
        embedding_case(&dev, dtype);
    }
}

fn embedding_case(dev: &Device, dtype: DType) {
    let dev = dev.clone();
    let (vocabulary, features) = (32_000, 16);
    dev.seed(3);
    let table = Tensor::randn([vocabulary, features], DType::F32, &dev).requires_grad();
    // 2,048 ids, many repeated (a small range of the table) so that gradients collide.
    let mut picked = ids(2048, 300, 7);
    picked.extend(ids(512, vocabulary, 8));
    let ids = index(picked, [2, 1280], dtype, &dev);
    let rows = ids.embedding(&table);
    assert_eq!(rows.dims(), &[2, 1280, features]);
    dev.seed(4);
    let weights = Tensor::randn([features], DType::F32, &dev);
    let loss = (&rows * &weights).tanh().sum();
    let grads = loss.backward().unwrap();
    let grad = grads.get(&table).unwrap();
    let stats = check_recorded(&[&rows, &loss, &grad]).unwrap();
    assert!(stats.checked > 500_000, "{dtype} ids: {stats:?}");
}

#[test]
fn gather_and_scatter_add_with_colliding_indices_match_the_reference() {
    let dev = braid::testing::test_device();
    for dtype in index_dtypes(&dev) {
        gather_scatter_case(&dev, dtype);
    }
}

fn gather_scatter_case(dev: &Device, dtype: DType) {
    let dev = dev.clone();
    dev.seed(5);
    let x = Tensor::randn([64, 300], DType::F32, &dev);
    let index = index(ids(64 * 2000, 300, 9), [64, 2000], dtype, &dev);
    // Along the last dimension (an index per element) and along the first (columns).
    let picked = x.gather(1, &index);
    let column_index = self::index(ids(500 * 300, 64, 10), [500, 300], dtype, &dev);
    let columns = x.t().gather(1, &column_index.t());
    let src = Tensor::randn([64, 2000], DType::F32, &dev);
    let summed = x.scatter_add(1, &index, &src);
    let ints = (&x * 100.0).to_dtype(DType::I32).scatter_add(1, &index, &(&src * 100.0).to_dtype(DType::I32));
    let halves = x.to_dtype(DType::BF16).scatter_add(1, &index, &src.to_dtype(DType::BF16));
    let stats = check_recorded(&[&picked, &columns, &summed, &ints, &halves]).unwrap();
    assert!(stats.checked > 100_000, "{dtype} indices: {stats:?}");
}

#[test]
fn scatter_add_gives_the_same_bits_at_any_thread_count() {
    // With one stream the CPU device runs a flush on the reading thread, so a read inside
    // `install` runs its kernels' rayon tasks in that pool.
    let run = |threads: usize, dtype: DType| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            let dev = Device::new_cpu();
            dev.seed(6);
            // 200,000 values into 50 targets per row: long sums whose bits depend on order.
            let src = Tensor::randn([8, 200_000], DType::F32, &dev);
            let index = index(ids(8 * 200_000, 50, 11), [8, 200_000], dtype, &dev);
            let base = Tensor::randn([8, 50], DType::F32, &dev);
            let rows = base.scatter_add(1, &index, &src);
            let table = Tensor::randn([1000, 64], DType::F32, &dev).requires_grad();
            let lookups = self::index(ids(100_000, 1000, 12), [100_000], dtype, &dev);
            let grads = lookups.embedding(&table).sin().sum().backward().unwrap();
            let bits = |t: &Tensor| t.to_vec::<f32>().unwrap().into_iter().map(f32::to_bits).collect::<Vec<_>>();
            (bits(&rows), bits(&grads.get(&table).unwrap()))
        })
    };
    let one = run(1, DType::I64);
    for threads in [2, 3, 8] {
        assert!(one == run(threads, DType::I64), "results differ between 1 and {threads} threads");
    }
    assert!(one == run(2, DType::I32), "i32 indices give other bits than i64");
}

#[test]
fn a_lookup_is_one_kernel_whatever_the_tables_size() {
    let dev = braid::testing::test_device();
    for dtype in index_dtypes(&dev) {
        one_kernel_case(&dev, dtype);
    }
}

fn one_kernel_case(dev: &Device, dtype: DType) {
    let dev = dev.clone();
    let table = Tensor::randn([50_000, 8], DType::F32, &dev);
    table.to_vec::<f32>().unwrap();
    let ids = index(vec![49_999, 0, 7], [3], dtype, &dev);
    let rows = ids.embedding(&table);
    let values = rows.to_vec::<f32>().unwrap();
    let text = dev.last_schedule().unwrap().to_text();
    assert!(text.contains("1 kernel(s)") && text.contains("index_select"), "{text}");
    let table = table.to_vec::<f32>().unwrap();
    assert_eq!(values[..8], table[49_999 * 8..]);
    assert_eq!(values[8..16], table[..8]);
    assert_eq!(values[16..], table[56..64]);
}

#[test]
fn a_lookups_gradient_scatters_into_no_table_of_zeros() {
    let dev = braid::testing::test_device();
    for dtype in index_dtypes(&dev) {
        no_zeros_case(&dev, dtype);
    }
}

fn no_zeros_case(dev: &Device, dtype: DType) {
    let dev = dev.clone();
    let (vocabulary, features) = (50_000, 16);
    let table = Tensor::randn([vocabulary, features], DType::F32, &dev).requires_grad();
    table.to_vec::<f32>().unwrap();
    let ids = index(vec![3, 49_999, 3], [3], dtype, &dev);
    let grads = ids.embedding(&table).sum().backward().unwrap();
    let grad = grads.get(&table).unwrap().to_vec::<f32>().unwrap();
    // The scatter-add's base of zeros is folded into it: the flush holds one table-sized buffer
    // (the gradient), not two.
    let text = dev.last_schedule().unwrap().to_text();
    let table_bytes = vocabulary * features * 4;
    let peak: usize = text.split("planned peak ").nth(1).and_then(|t| t.split(' ').next()).unwrap().parse().unwrap();
    assert!(text.contains("scatter_add") && peak < 2 * table_bytes, "{text}");
    assert_eq!(grad[3 * features..4 * features], [2.0; 16]);
    assert_eq!(grad[49_999 * features..], [1.0; 16]);
    assert_eq!(grad.iter().filter(|&&g| g != 0.0).count(), 2 * features);
    // A bf16 table: the sums run in f32 (4 bytes an element) and are rounded to bf16 (2); no
    // table of zeros in either type.
    let table = table.detach().to_dtype(DType::BF16).requires_grad();
    dev.sync().unwrap();
    let grads = ids.embedding(&table).sum().backward().unwrap();
    let grad = grads.get(&table).unwrap();
    dev.sync().unwrap();
    let text = dev.last_schedule().unwrap().to_text();
    let grad = grad.to_dtype(DType::F32).to_vec::<f32>().unwrap();
    let peak: usize = text.split("planned peak ").nth(1).and_then(|t| t.split(' ').next()).unwrap().parse().unwrap();
    assert!(peak < 7 * vocabulary * features + 4096, "{text}");
    assert_eq!(grad[3 * features..4 * features], [2.0; 16]);
    assert_eq!(grad.iter().filter(|&&g| g != 0.0).count(), 2 * features);
}

#[test]
fn cross_entropy_of_targets_in_and_out_of_range_matches_its_definition() {
    // A target outside `0..classes` picks nothing: its row's loss is `logsumexp(row - max)`;
    // the others `logsumexp(row) - row[target]`. Large logits (around 40) so that forgetting
    // the shift on either side is far outside the tolerance.
    let dev = braid::testing::test_device();
    let (rows, classes) = (6, 37);
    dev.seed(11);
    let logits = (Tensor::randn([rows, classes], DType::F32, &dev) * 3.0) + 40.0;
    let values = logits.to_vec::<f32>().unwrap();
    let picked: [i64; 6] = [0, 36, -1, 37, 5, 1000];
    let mut want = 0.0f64;
    for (r, &t) in picked.iter().enumerate() {
        let row: Vec<f64> = values[r * classes..(r + 1) * classes].iter().map(|&v| v as f64).collect();
        let max = row.iter().cloned().fold(f64::MIN, f64::max);
        let shifted_lse = row.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
        let shifted_target = if (0..classes as i64).contains(&t) { row[t as usize] - max } else { 0.0 };
        want += (shifted_lse - shifted_target) / rows as f64;
    }
    for dtype in index_dtypes(&dev) {
        let target = index(picked.to_vec(), [rows], dtype, &dev);
        let got = logits.cross_entropy(&target).item::<f32>().unwrap() as f64;
        assert!((got - want).abs() <= 1e-5 * want.abs().max(1.0), "{dtype} targets: {got} against {want}");
        check_recorded(&[&logits.cross_entropy(&target)]).unwrap();
    }
}

#[test]
fn a_scatter_writes_over_its_base_in_place_and_matches_the_reference() {
    let dev = braid::testing::test_device();
    for dtype in index_dtypes(&dev) {
        scatter_case(&dev, dtype);
    }
}

/// A key/value cache `[3, 2, 9, 5]` with a new row a sequence written at its own position
/// (one out of range), in f32, bf16 and i32; then rows colliding along the dimension (the last
/// one wins). Written over the cache's buffer when nothing else holds the old value.
fn scatter_case(dev: &Device, dtype: DType) {
    let dev = dev.clone();
    dev.seed(6);
    let (b, h, t, d) = (3, 2, 9, 5);
    let positions = index(vec![4, 0, 9], [b, 1, 1, 1], dtype, &dev).expand([b, h, 1, d]);
    for value in [DType::F32, DType::BF16, DType::I32] {
        let cache = (Tensor::randn([b, h, t, d], DType::F32, &dev) * 10.0).to_dtype(value);
        let new = (Tensor::randn([b, h, 1, d], DType::F32, &dev) * 10.0).to_dtype(value);
        let written = cache.scatter(2, &positions, &new);
        let stats = check_recorded(&[&written]).unwrap();
        assert_eq!(stats.checked, b * h * t * d, "{value}: {stats:?}");
        // In place: the cache's old value is held by nothing else once it moves on.
        let identity = braid::testing::buffer_identity(&cache).unwrap();
        cache.scatter_assign(2, &positions, &new);
        assert_eq!(braid::testing::buffer_identity(&cache).unwrap(), identity, "{value}: the cache was copied");
        let text = dev.last_schedule().unwrap().to_text();
        assert!(text.contains("(in place"), "{value}: the scatter was not written over the cache:\n{text}");
        let as_f32 = |t: &Tensor| t.to_dtype(DType::F32).to_vec::<f32>().unwrap();
        assert_eq!(as_f32(&cache), as_f32(&written), "{value}");
    }
    // Four rows a sequence, colliding along the positions: the last write wins.
    let colliding = index(vec![1, 3, 1, 1, 0, 0, 8, 0, 2, 5, 7, 5], [b, 1, 4, 1], dtype, &dev).expand([b, h, 4, d]);
    let cache = Tensor::randn([b, h, t, d], DType::F32, &dev);
    let rows = Tensor::randn([b, h, 4, d], DType::F32, &dev);
    let written = cache.scatter(2, &colliding, &rows);
    check_recorded(&[&written]).unwrap();
    let cache = cache.to_vec::<f32>().unwrap();
    let (rows, written) = (rows.to_vec::<f32>().unwrap(), written.to_vec::<f32>().unwrap());
    // Sequence 0, head 0, element 0: position 1 holds the fourth row's (n = 3), position 3 the
    // second's, position 2 the cache's own.
    assert_eq!(written[d], rows[3 * d]);
    assert_eq!(written[3 * d], rows[d]);
    assert_eq!(written[2 * d], cache[2 * d]);
}
