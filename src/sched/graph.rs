//! Cell graphs: a request unfolded into the cells it needs (BatchMaker §4.2).
//!
//! A recurrent request is a DAG of *nodes*; each node is one invocation of a *cell type* (a
//! function with its own weights: an LSTM step, a Seq2Seq encoder or decoder step, a TreeLSTM
//! leaf or internal node) and depends on the nodes whose outputs it reads. The graph is pure
//! structure: which node computes what is the model's business (`model::unfold`), how nodes are
//! batched is the policy's (`sched::cellular`, `sched::baseline::padding`).
//!
//! Node ids are `0..len()`. Every edge goes from a node to one of its predecessors, and cell types
//! are numbered so that dependencies never go from a lower type to a higher one (encoder 0 before
//! decoder 1, leaf 0 before internal 1): running the types in index order is always possible.

use std::sync::{Arc, LazyLock};

use crate::error::{Error, Result};

/// Index of a cell type within a model (seq2seq: 0 = encoder, 1 = decoder; treelstm: 0 = leaf,
/// 1 = internal).
pub type CellType = u8;

/// The most cell types a model may have.
pub const MAX_CELL_TYPES: usize = 8;

/// A maximal run of same-type nodes of a chain graph: nodes `start..end`, each depending on the
/// one before it (the first on the last node of the previous run). A run is one subgraph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    pub ty: CellType,
    pub start: u32,
    pub end: u32,
}

impl Run {
    /// Its node count.
    pub fn len(&self) -> usize {
        (self.end - self.start) as usize
    }

    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }
}

/// The subgraph structure of a graph that is not a path, for a request processor that tracks
/// dependencies node by node (`sched::cellular`). Found once when the graph is built — on the
/// thread that submits the request — so that a scheduler only copies it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubgraphPlan {
    /// Per node: its subgraph ([`CellGraph::subgraphs`]) and its same-subgraph predecessors.
    pub node_sg: Vec<u32>,
    pub internal_preds: Vec<u32>,
    /// Successors of node `v`, ascending: those in its subgraph at
    /// `succ[succ_start[v]..succ_ext[v]]`, those in other subgraphs at
    /// `succ[succ_ext[v]..succ_start[v + 1]]`.
    pub succ_start: Vec<u32>,
    pub succ_ext: Vec<u32>,
    pub succ: Vec<u32>,
    /// Per subgraph: its cell type, its predecessors outside it, and its roots (nodes with no
    /// same-subgraph predecessor), ascending, at `roots[roots_start[s]..roots_start[s + 1]]`.
    pub sg_type: Vec<CellType>,
    pub external_preds: Vec<u32>,
    pub roots_start: Vec<u32>,
    pub roots: Vec<u32>,
}

/// The shape of a TreeLSTM request, and of any graph like it: every node with no predecessor (a
/// *leaf*) is a subgraph of its own, all leaves have one cell type and at least one successor,
/// and all other nodes form one subgraph, the *inner* subgraph. A scheduler can then treat the
/// leaves as one list, ready on arrival, and the inner subgraph level by level: it becomes
/// schedulable once every leaf has finished, and a node of it at level `k` (one more than its
/// highest inner predecessor, 0 with none) is ready once levels `0..k` are submitted. The leaf
/// type is below the inner type (edges never go from a higher type to a lower one), so a task's
/// cell type says which part of a tree request it holds.
///
/// The lists are one allocation, which the graph holds directly: a scheduler copies it when a
/// request arrives, and the graph is cold then (a cache miss per pointer followed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TreeShape {
    pub leaf_type: CellType,
    pub inner_type: CellType,
    leaves: u32,
    inner: u32,
    /// [`TreeShape::leaves`], then [`TreeShape::order`], then [`TreeShape::level_end`].
    lists: Box<[u32]>,
}

impl TreeShape {
    /// The tree shape of `g`, whose subgraph structure is `plan`, if it has one. Levels come from the plan's inner successor lists: no second pass over the graph.
    fn of(g: &CellGraph, plan: &SubgraphPlan) -> Option<TreeShape> {
        let n = g.len();
        let is_leaf = |v: usize| g.pred_list(v).is_empty();
        let first_inner = (0..n).find(|&v| !is_leaf(v))?;
        let inner_sg = plan.node_sg[first_inner];
        let leaves: Vec<u32> = (0..n as u32).filter(|&v| is_leaf(v as usize)).collect();
        let leaf_type = g.types[leaves[0] as usize];
        let leaves_ok = leaves.iter().map(|&v| v as usize).all(|v| {
            g.types[v] == leaf_type
                && plan.succ_start[v + 1] > plan.succ_start[v]
                && plan.node_sg[v] != inner_sg
        });
        // Every inner node in one subgraph; a leaf is then a subgraph of its own, since a leaf
        // next to a node of its type would share that node's subgraph.
        let inner_ok = (0..n).all(|v| is_leaf(v) || plan.node_sg[v] == inner_sg);
        if !(leaves_ok && inner_ok) {
            return None;
        }
        // Levels, in a topological pass from the inner subgraph's roots (level 0).
        let sg = inner_sg as usize;
        let mut order = plan.roots[plan.roots_start[sg] as usize..plan.roots_start[sg + 1] as usize].to_vec();
        let (mut level, mut left) = (vec![0u32; n], plan.internal_preds.clone());
        let mut next = 0;
        while let Some(&v) = order.get(next) {
            next += 1;
            for &s in plan.internal_successors(v) {
                level[s as usize] = level[s as usize].max(level[v as usize] + 1);
                left[s as usize] -= 1;
                if left[s as usize] == 0 {
                    order.push(s);
                }
            }
        }
        order.sort_by_key(|&v| (level[v as usize], v));
        // Each level's end: where the next level starts, then the end of `order`.
        let mut level_end: Vec<u32> = (1..order.len())
            .filter(|&i| level[order[i] as usize] != level[order[i - 1] as usize])
            .map(|i| i as u32)
            .collect();
        level_end.push(order.len() as u32);
        let (n_leaves, inner) = (leaves.len() as u32, order.len() as u32);
        let lists = [leaves, order, level_end].concat().into_boxed_slice();
        Some(TreeShape { leaf_type, inner_type: g.types[first_inner], leaves: n_leaves, inner, lists })
    }

    /// The leaves, ascending.
    pub fn leaves(&self) -> &[u32] {
        &self.lists[..self.leaves as usize]
    }

    /// The inner nodes by level, ascending within a level: level `k` is
    /// `order()[level_end()[k - 1]..level_end()[k]]` (from 0 for `k = 0`).
    pub fn order(&self) -> &[u32] {
        &self.lists[self.leaves as usize..(self.leaves + self.inner) as usize]
    }

    /// Each level's end in [`TreeShape::order`].
    pub fn level_end(&self) -> &[u32] {
        &self.lists[(self.leaves + self.inner) as usize..]
    }

    /// The three lists, one after another.
    pub fn lists(&self) -> &[u32] {
        &self.lists
    }
}

impl SubgraphPlan {
    fn of(g: &CellGraph) -> SubgraphPlan {
        let n = g.len();
        let (node_sg, count) = g.subgraphs();
        let mut internal_preds = vec![0u32; n];
        let mut internal_succs = vec![0u32; n];
        let mut external_succs = vec![0u32; n];
        let mut sg_type = vec![0; count];
        let mut external_preds = vec![0u32; count];
        let mut roots_count = vec![0u32; count];
        for v in 0..n {
            let sg = node_sg[v] as usize;
            sg_type[sg] = g.types[v];
            for &p in g.pred_list(v) {
                if node_sg[p as usize] as usize == sg {
                    internal_preds[v] += 1;
                    internal_succs[p as usize] += 1;
                } else {
                    external_preds[sg] += 1;
                    external_succs[p as usize] += 1;
                }
            }
            if internal_preds[v] == 0 {
                roots_count[sg] += 1;
            }
        }
        // Offsets, then the lists filled in ascending node order (so each list ascends).
        let mut succ_start = Vec::with_capacity(n + 1);
        let mut succ_ext = Vec::with_capacity(n);
        let mut at = 0;
        for v in 0..n {
            succ_start.push(at);
            succ_ext.push(at + internal_succs[v]);
            at += internal_succs[v] + external_succs[v];
        }
        succ_start.push(at);
        let mut roots_start = Vec::with_capacity(count + 1);
        let mut r = 0;
        for &c in &roots_count {
            roots_start.push(r);
            r += c;
        }
        roots_start.push(r);
        let mut succ = vec![0u32; at as usize];
        let mut roots = vec![0u32; r as usize];
        let (mut fill_int, mut fill_ext) = (succ_start.clone(), succ_ext.clone());
        let mut fill_root = roots_start.clone();
        for v in 0..n {
            let sg = node_sg[v];
            for &p in g.pred_list(v) {
                let cursor = if node_sg[p as usize] == sg { &mut fill_int } else { &mut fill_ext };
                succ[cursor[p as usize] as usize] = v as u32;
                cursor[p as usize] += 1;
            }
            if internal_preds[v] == 0 {
                roots[fill_root[sg as usize] as usize] = v as u32;
                fill_root[sg as usize] += 1;
            }
        }
        SubgraphPlan {
            node_sg,
            internal_preds,
            succ_start,
            succ_ext,
            succ,
            sg_type,
            external_preds,
            roots_start,
            roots,
        }
    }

    /// The successors of node `v` in its own subgraph, ascending.
    pub(crate) fn internal_successors(&self, v: u32) -> &[u32] {
        &self.succ[self.succ_start[v as usize] as usize..self.succ_ext[v as usize] as usize]
    }
}

/// A request as a DAG of cells. Immutable once built.
///
/// A path (an `lstm` or `seq2seq` request) is kept as its runs alone: its size costs nothing, so
/// a Seq2Seq decoder chain of `max_decode` nodes is a number, and a decode grows as it runs
/// (schedulers follow a path with a cursor). Only other graphs keep per-node lists.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CellGraph {
    /// Nodes: `0..len`.
    len: u32,
    /// Not a path: each node's cell type, and `preds[pred_start[i]..pred_start[i + 1]]` the
    /// nodes node `i` depends on. Empty for a path.
    types: Vec<CellType>,
    pred_start: Vec<u32>,
    preds: Vec<u32>,
    /// The graph's runs when it is one path `0 → 1 → … → len − 1` (an `lstm` or `seq2seq`
    /// request): schedulers track such a request by a cursor instead of per-node state.
    runs: Option<Vec<Run>>,
    /// Copies of what a scheduler reads when the request arrives, so that it reads only this
    /// struct: the first run (`None` unless a path) and the highest cell type.
    first_run: Option<Run>,
    max_type: CellType,
    /// The subgraph structure when the graph is not a path.
    plan: Option<Box<SubgraphPlan>>,
    /// The tree shape, when the graph has one (see [`TreeShape`]).
    tree: Option<TreeShape>,
}

/// The nodes one node depends on ([`CellGraph::preds`]): a list, or on a path the node before.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preds<'a> {
    List(&'a [u32]),
    Path(Option<u32>),
}

impl<'a> Preds<'a> {
    pub fn len(&self) -> usize {
        match self {
            Preds::List(l) => l.len(),
            Preds::Path(p) => usize::from(p.is_some()),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn iter(&self) -> PredsIter<'a> {
        let (list, one) = match *self {
            Preds::List(l) => (l, None),
            Preds::Path(p) => (&[][..], p),
        };
        list.iter().copied().chain(one)
    }

    pub fn to_vec(&self) -> Vec<u32> {
        self.iter().collect()
    }
}

impl<'a> IntoIterator for Preds<'a> {
    type Item = u32;
    type IntoIter = PredsIter<'a>;
    fn into_iter(self) -> PredsIter<'a> {
        self.iter()
    }
}

/// Iterator over [`Preds`].
pub type PredsIter<'a> =
    std::iter::Chain<std::iter::Copied<std::slice::Iter<'a, u32>>, std::option::IntoIter<u32>>;

impl CellGraph {
    /// Most nodes a graph may have: node ids are `u32`, and schedulers keep the top two values
    /// for their own marks.
    pub const MAX_NODES: usize = (u32::MAX - 2) as usize;

    /// The graph of a fixed-shape request (an arrival without cells): one cell of type 0. Built
    /// once, shared.
    pub(crate) fn single() -> Arc<CellGraph> {
        static SINGLE: LazyLock<Arc<CellGraph>> =
            LazyLock::new(|| Arc::new(CellGraph::chains(&[(0, 1)]).expect("one node fits")));
        SINGLE.clone()
    }

    /// Chains run one after another: chain `k` has `len` nodes of cell type `ty`, each depending on
    /// its predecessor, and its first node depends on the last node of chain `k − 1`. An `lstm`
    /// request is one chain; a `seq2seq` request is the encoder chain then the decoder chain.
    /// Costs one [`Run`] per chain whatever the lengths. Fails with more than
    /// [`CellGraph::MAX_NODES`] nodes, or with cell types that go down (a type's nodes never
    /// depend on a higher type's).
    pub fn chains(chains: &[(CellType, usize)]) -> Result<CellGraph> {
        let mut runs: Vec<Run> = Vec::new();
        let mut len = 0u32;
        for &(ty, n) in chains {
            if n == 0 {
                continue;
            }
            let end = u32::try_from(n)
                .ok()
                .and_then(|n| len.checked_add(n))
                .filter(|&e| e as usize <= CellGraph::MAX_NODES)
                .ok_or_else(|| {
                    Error::invalid(format!(
                        "a graph of more than {} nodes is too large",
                        CellGraph::MAX_NODES
                    ))
                })?;
            match runs.last_mut() {
                Some(r) if r.ty == ty => r.end = end,
                Some(r) if r.ty > ty => {
                    return Err(Error::internal(format!("chain of type {ty} after one of type {}", r.ty)));
                }
                _ => runs.push(Run { ty, start: len, end }),
            }
            len = end;
        }
        Ok(CellGraph::path(runs))
    }

    /// A path made of `runs` (consecutive, types ascending; empty for the empty graph).
    fn path(runs: Vec<Run>) -> CellGraph {
        let len = runs.last().map_or(0, |r| r.end);
        let max_type = runs.last().map_or(0, |r| r.ty);
        CellGraph {
            len,
            types: Vec::new(),
            pred_start: Vec::new(),
            preds: Vec::new(),
            first_run: runs.first().copied(),
            runs: (!runs.is_empty()).then_some(runs),
            max_type,
            plan: None,
            tree: None,
        }
    }

    /// A graph from each node's type and predecessor list. Fails on a predecessor out of range,
    /// a self-edge, a cycle, or an edge from a higher cell type to a lower one.
    pub fn new(types: Vec<CellType>, preds: &[Vec<u32>]) -> Result<CellGraph> {
        let n = types.len();
        if preds.len() != n {
            return Err(Error::internal(format!("{n} node types but {} predecessor lists", preds.len())));
        }
        if n > CellGraph::MAX_NODES {
            return Err(Error::invalid(format!("a graph of {n} nodes is too large")));
        }
        let mut g = CellGraph {
            len: n as u32,
            types,
            pred_start: Vec::with_capacity(n + 1),
            preds: Vec::new(),
            runs: None,
            first_run: None,
            max_type: 0,
            plan: None,
            tree: None,
        };
        g.pred_start.push(0);
        for (i, ps) in preds.iter().enumerate() {
            for &p in ps {
                let Some(&pt) = g.types.get(p as usize) else {
                    return Err(Error::internal(format!("node {i} depends on node {p}, out of range")));
                };
                if p as usize == i || pt > g.types[i] {
                    return Err(Error::internal(format!("node {i} cannot depend on node {p}")));
                }
                g.preds.push(p);
            }
            g.pred_start.push(g.preds.len() as u32);
        }
        if let Some(runs) = g.find_runs() {
            return Ok(CellGraph::path(runs));
        }
        if g.topological_order().is_none() {
            return Err(Error::internal("the cell graph has a cycle".to_string()));
        }
        g.max_type = g.types.iter().copied().max().unwrap_or(0);
        if !g.is_empty() {
            let plan = SubgraphPlan::of(&g);
            g.tree = TreeShape::of(&g, &plan);
            g.plan = Some(Box::new(plan));
        }
        Ok(g)
    }

    /// A tree: node `i` depends on its children `children[i]`; a leaf (no children) runs cell
    /// type `leaf`, an internal node cell type `internal` (TreeLSTM's two cells).
    pub fn tree(children: &[Vec<u32>], leaf: CellType, internal: CellType) -> Result<CellGraph> {
        CellGraph::new(
            children.iter().map(|c| if c.is_empty() { leaf } else { internal }).collect(),
            children,
        )
    }

    /// The graph of a tree given as each node's parent index (-1 for the root), checked by
    /// [`validate_tree`]: a leaf runs cell type `leaf`, an internal node `internal`.
    pub fn tree_of_parents(parents: &[i32], leaf: CellType, internal: CellType) -> Result<CellGraph> {
        let tree = validate_tree(parents, usize::MAX)?;
        CellGraph::tree(&tree.children, leaf, internal)
    }

    /// The subgraph structure, for a graph that is not a path (`None` for a path: see
    /// [`CellGraph::runs`]; and for an empty graph).
    pub fn plan(&self) -> Option<&SubgraphPlan> {
        self.plan.as_deref()
    }

    /// The tree shape, for a graph that has one.
    pub fn tree_shape(&self) -> Option<&TreeShape> {
        self.tree.as_ref()
    }

    /// The runs of a graph given by lists, if it is a path (every node but the first depends on
    /// exactly the node before it).
    fn find_runs(&self) -> Option<Vec<Run>> {
        let n = self.len();
        if n == 0 || !self.pred_list(0).is_empty() || (1..n).any(|v| self.pred_list(v) != [v as u32 - 1]) {
            return None;
        }
        let mut runs: Vec<Run> = Vec::new();
        for (v, &ty) in self.types.iter().enumerate() {
            match runs.last_mut() {
                Some(r) if r.ty == ty => r.end += 1,
                _ => runs.push(Run { ty, start: v as u32, end: v as u32 + 1 }),
            }
        }
        Some(runs)
    }

    /// The runs of this graph if it is a path (see [`Run`]): its subgraphs, in order.
    pub fn runs(&self) -> Option<&[Run]> {
        self.runs.as_deref()
    }

    /// `runs()[0]`, without reading the runs.
    pub fn first_run(&self) -> Option<Run> {
        self.first_run
    }

    /// The highest cell type of any node (0 for an empty graph).
    pub fn max_type(&self) -> CellType {
        self.max_type
    }

    pub fn len(&self) -> usize {
        self.len as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn cell_type(&self, node: usize) -> CellType {
        match &self.runs {
            Some(runs) => {
                assert!(node < self.len(), "node {node} of a graph of {}", self.len);
                runs[runs.partition_point(|r| r.end as usize <= node)].ty
            }
            None => self.types[node],
        }
    }

    /// Every node's cell type, in node order (one entry per node even for a path: for tests and
    /// diagnostics, not for schedulers).
    pub fn types(&self) -> Vec<CellType> {
        match &self.runs {
            Some(runs) => runs.iter().flat_map(|r| std::iter::repeat_n(r.ty, r.len())).collect(),
            None => self.types.clone(),
        }
    }

    /// The nodes `node` depends on.
    pub fn preds(&self, node: usize) -> Preds<'_> {
        match &self.runs {
            Some(_) => {
                assert!(node < self.len(), "node {node} of a graph of {}", self.len);
                Preds::Path(node.checked_sub(1).map(|p| p as u32))
            }
            None => Preds::List(self.pred_list(node)),
        }
    }

    /// The predecessor list of `node` of a graph that is not a path (what the construction-time
    /// analyses read: no [`Preds`] match per node).
    fn pred_list(&self, node: usize) -> &[u32] {
        &self.preds[self.pred_start[node] as usize..self.pred_start[node + 1] as usize]
    }

    /// Successor lists in CSR form: `(start, succs)` with node `i`'s successors at
    /// `succs[start[i]..start[i + 1]]`.
    fn successors(&self) -> (Vec<u32>, Vec<u32>) {
        let n = self.len();
        let mut start = vec![0u32; n + 1];
        for &p in &self.preds {
            start[p as usize + 1] += 1;
        }
        for i in 0..n {
            start[i + 1] += start[i];
        }
        let mut fill = start.clone();
        let mut succs = vec![0u32; self.preds.len()];
        for i in 0..n {
            for &p in self.pred_list(i) {
                succs[fill[p as usize] as usize] = i as u32;
                fill[p as usize] += 1;
            }
        }
        (start, succs)
    }

    /// A topological order (predecessors first), or `None` if the graph has a cycle.
    fn topological_order(&self) -> Option<Vec<u32>> {
        let n = self.len();
        let (start, succs) = self.successors();
        let mut left: Vec<u32> = (0..n).map(|i| self.pred_list(i).len() as u32).collect();
        let mut order: Vec<u32> = (0..n as u32).filter(|&i| left[i as usize] == 0).collect();
        let mut head = 0;
        while head < order.len() {
            let v = order[head] as usize;
            head += 1;
            for &s in &succs[start[v] as usize..start[v + 1] as usize] {
                left[s as usize] -= 1;
                if left[s as usize] == 0 {
                    order.push(s);
                }
            }
        }
        (order.len() == n).then_some(order)
    }

    /// Each node's level within its cell type: 0 when no predecessor has the same type, else one
    /// more than the highest such predecessor. Running `(type, level)` groups in order (types
    /// ascending, then levels ascending) respects every dependency; the padding baseline batches
    /// requests level by level this way.
    pub fn levels(&self) -> Vec<u32> {
        if let Some(runs) = &self.runs {
            return runs.iter().flat_map(|r| 0..r.end - r.start).collect();
        }
        let order = self.topological_order().expect("graphs are acyclic by construction");
        let mut level = vec![0u32; self.len()];
        for &v in &order {
            let v = v as usize;
            let ty = self.types[v];
            level[v] = self
                .pred_list(v)
                .iter()
                .filter(|&&p| self.types[p as usize] == ty)
                .map(|&p| level[p as usize] + 1)
                .max()
                .unwrap_or(0);
        }
        level
    }

    /// Subgraphs (BatchMaker §4.2): the connected components of same-type nodes. Returns each
    /// node's subgraph index and the number of subgraphs; subgraphs are numbered in order of
    /// their lowest node.
    pub(crate) fn subgraphs(&self) -> (Vec<u32>, usize) {
        if let Some(runs) = &self.runs {
            let of =
                (0..runs.len() as u32).flat_map(|k| std::iter::repeat_n(k, runs[k as usize].len())).collect();
            return (of, runs.len());
        }
        let n = self.len();
        let mut parent: Vec<u32> = (0..n as u32).collect();
        fn find(parent: &mut [u32], mut x: u32) -> u32 {
            while parent[x as usize] != x {
                let up = parent[parent[x as usize] as usize];
                parent[x as usize] = up;
                x = up;
            }
            x
        }
        for i in 0..n {
            for &p in self.pred_list(i) {
                if self.types[p as usize] == self.types[i] {
                    let (a, b) = (find(&mut parent, i as u32), find(&mut parent, p));
                    if a != b {
                        // Keep the lower id as the root so numbering follows the lowest node.
                        let (lo, hi) = if a < b { (a, b) } else { (b, a) };
                        parent[hi as usize] = lo;
                    }
                }
            }
        }
        let mut index = vec![u32::MAX; n];
        let mut of = vec![0u32; n];
        let mut count = 0u32;
        for (i, slot) in of.iter_mut().enumerate() {
            let root = find(&mut parent, i as u32) as usize;
            if index[root] == u32::MAX {
                index[root] = count;
                count += 1;
            }
            *slot = index[root];
        }
        (of, count as usize)
    }
}

/// A validated tree: children of each node and the root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tree {
    pub children: Vec<Vec<u32>>,
    pub root: u32,
}

/// Check a tree given as parent indices and return its children lists. Errors say which node.
pub fn validate_tree(parents: &[i32], max_nodes: usize) -> Result<Tree> {
    let n = parents.len();
    if n == 0 {
        return Err(Error::invalid("empty tree: a tree needs at least one node"));
    }
    if n > max_nodes {
        return Err(Error::invalid(format!(
            "tree of {n} nodes is larger than this model's maximum of {max_nodes}"
        )));
    }
    let mut root: Option<usize> = None;
    let mut children = vec![Vec::new(); n];
    for (i, &p) in parents.iter().enumerate() {
        if p == -1 {
            if let Some(r) = root {
                return Err(Error::invalid(format!(
                    "tree has two roots: nodes {r} and {i} both have parent -1"
                )));
            }
            root = Some(i);
        } else if p < 0 || p as usize >= n {
            return Err(Error::invalid(format!(
                "node {i} has parent {p}, outside the tree (parents are -1 or 0..{n})"
            )));
        } else if p as usize == i {
            return Err(Error::invalid(format!("node {i} is its own parent (a cycle)")));
        } else {
            children[p as usize].push(i as u32);
        }
    }
    let Some(root) = root else {
        return Err(Error::invalid("tree has no root: no node has parent -1 (so the parents form a cycle)"));
    };
    // Every node must reach the root; one that does not lies on (or under) a cycle.
    let mut seen = vec![false; n];
    let mut stack = vec![root];
    seen[root] = true;
    while let Some(v) = stack.pop() {
        for &c in &children[v] {
            seen[c as usize] = true;
            stack.push(c as usize);
        }
    }
    if let Some(lost) = seen.iter().position(|s| !s) {
        // Walk up from the lost node until a node repeats: that node is on the cycle.
        let mut on_path = vec![false; n];
        let mut v = lost;
        while !on_path[v] {
            on_path[v] = true;
            v = parents[v] as usize;
        }
        return Err(Error::invalid(format!(
            "node {v} is on a cycle of parent links (it never reaches the root, node {root})"
        )));
    }
    Ok(Tree { children, root: root as u32 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_link_end_to_start() {
        let g = CellGraph::chains(&[(0, 3), (1, 2)]).unwrap();
        assert_eq!(g.types(), vec![0, 0, 0, 1, 1]);
        assert_eq!(
            (g.preds(0).to_vec(), g.preds(3).to_vec(), g.preds(4).to_vec()),
            (vec![], vec![2], vec![3])
        );
        assert_eq!((0..5).map(|v| g.cell_type(v)).collect::<Vec<_>>(), g.types());
        assert_eq!(g.levels(), vec![0, 1, 2, 0, 1]);
        assert_eq!(g.subgraphs(), (vec![0, 0, 0, 1, 1], 2));
        assert_eq!(g.runs(), Some(&[Run { ty: 0, start: 0, end: 3 }, Run { ty: 1, start: 3, end: 5 }][..]));
        // Same-type chains merge into one run (one subgraph); an empty chain adds nothing.
        let g = CellGraph::chains(&[(0, 2), (0, 0), (0, 1)]).unwrap();
        assert_eq!(g.runs(), Some(&[Run { ty: 0, start: 0, end: 3 }][..]));
        assert_eq!(g.runs().map(<[Run]>::len), Some(g.subgraphs().1));
        assert_eq!((g.first_run(), g.max_type()), (Some(Run { ty: 0, start: 0, end: 3 }), 0));
    }

    #[test]
    fn a_chain_costs_its_runs_not_its_length() {
        // A Seq2Seq request with a decoder chain as long as node ids allow: two runs, no per-node
        // lists (per-node lists here would be ~38 GB).
        let n = CellGraph::MAX_NODES;
        let g = CellGraph::chains(&[(0, 5), (1, n - 5)]).unwrap();
        assert_eq!((g.len(), g.max_type(), g.runs().map(<[Run]>::len)), (n, 1, Some(2)));
        assert_eq!((g.cell_type(4), g.cell_type(5), g.cell_type(n - 1)), (0, 1, 1));
        assert_eq!((g.preds(0).to_vec(), g.preds(n - 1).to_vec()), (vec![], vec![n as u32 - 2]));
        assert_eq!(g.types.capacity() + g.preds.capacity() + g.pred_start.capacity(), 0);
        // One node more, or a length past u32, is refused; so are types going down.
        for too_big in [&[(0, 5), (1, n - 4)][..], &[(0, usize::MAX)], &[(0, n), (0, n)]] {
            let e = CellGraph::chains(too_big).unwrap_err();
            assert!(e.message().contains("too large"), "{e}");
        }
        assert!(CellGraph::chains(&[(1, 2), (0, 2)]).is_err());
        // A path given as lists is stored the same way.
        let g = CellGraph::new(vec![0, 1, 1], &[vec![], vec![0], vec![1]]).unwrap();
        assert_eq!(g, CellGraph::chains(&[(0, 1), (1, 2)]).unwrap());
        assert_eq!(g.types.capacity() + g.preds.capacity(), 0);
    }

    #[test]
    fn only_paths_have_runs() {
        let path = CellGraph::new(vec![0, 0, 1], &[vec![], vec![0], vec![1]]).unwrap();
        assert_eq!(path, CellGraph::chains(&[(0, 2), (1, 1)]).unwrap());
        // A fork, a join, two roots: no runs.
        let fork = CellGraph::new(vec![0, 0, 1], &[vec![], vec![0], vec![0]]).unwrap();
        assert_eq!((fork.runs(), fork.first_run(), fork.max_type()), (None, None, 1));
        assert_eq!(CellGraph::new(vec![0, 0, 1], &[vec![], vec![], vec![0, 1]]).unwrap().runs(), None);
        assert_eq!(CellGraph::new(vec![0, 0], &[vec![], vec![]]).unwrap().runs(), None);
        // A path whose edges skip a node id is not a chain of runs either.
        assert_eq!(CellGraph::new(vec![0, 0, 0], &[vec![], vec![2], vec![0]]).unwrap().runs(), None);
    }

    #[test]
    fn tree_subgraphs_are_single_leaves_and_connected_internals() {
        // 0 = root(internal) with children 1 (internal) and 2 (leaf); 1 has leaves 3, 4.
        let g =
            CellGraph::new(vec![1, 1, 0, 0, 0], &[vec![1, 2], vec![3, 4], vec![], vec![], vec![]]).unwrap();
        let (of, count) = g.subgraphs();
        assert_eq!(count, 4);
        assert_eq!(of[0], of[1]);
        assert!(of[2] != of[3] && of[3] != of[4] && of[2] != of[0]);
        assert_eq!(g.levels(), vec![1, 0, 0, 0, 0]);
        assert_eq!(g.topological_order().unwrap().last(), Some(&0));
        // The plan a request processor copies: nodes 0 and 1 form subgraph 0 (root: node 1),
        // each leaf is its own subgraph and an external predecessor of subgraph 0.
        let plan = g.plan().expect("a tree is not a path");
        assert_eq!(plan.node_sg, vec![0, 0, 1, 2, 3]);
        assert_eq!(plan.internal_preds, vec![1, 0, 0, 0, 0]);
        let succ = |v: usize| {
            let (s, e, end) =
                (plan.succ_start[v] as usize, plan.succ_ext[v] as usize, plan.succ_start[v + 1] as usize);
            (plan.succ[s..e].to_vec(), plan.succ[e..end].to_vec())
        };
        assert_eq!(
            (succ(0), succ(1), succ(2), succ(3)),
            ((vec![], vec![]), (vec![0], vec![]), (vec![], vec![0]), (vec![], vec![1]))
        );
        assert_eq!((plan.sg_type.clone(), plan.external_preds.clone()), (vec![1, 0, 0, 0], vec![3, 0, 0, 0]));
        let roots =
            |s: usize| plan.roots[plan.roots_start[s] as usize..plan.roots_start[s + 1] as usize].to_vec();
        assert_eq!((roots(0), roots(1), roots(3)), (vec![1], vec![2], vec![4]));
        assert_eq!(CellGraph::chains(&[(0, 3)]).unwrap().plan(), None, "a path has runs instead");
    }

    #[test]
    fn tree_shape_lists_leaves_and_inner_levels() {
        // 0 = root over 1 (internal) and 2 (leaf); 1 over 3 (internal) and 4 (leaf); 3 over
        // leaves 5, 6. Inner levels: 3, then 1, then 0.
        let g = CellGraph::tree_of_parents(&[-1, 0, 0, 1, 1, 3, 3], 0, 1).unwrap();
        let shape = g.tree_shape().expect("a tree has a tree shape");
        assert_eq!((shape.leaf_type, shape.inner_type), (0, 1));
        assert_eq!(
            (shape.leaves(), shape.order(), shape.level_end()),
            (&[2, 4, 5, 6][..], &[3, 1, 0][..], &[1, 2, 3][..])
        );
        assert_eq!(shape.lists(), [2, 4, 5, 6, 3, 1, 0, 1, 2, 3]);
        // A bushy tree: levels hold several nodes, ascending.
        let g = CellGraph::tree_of_parents(&[-1, 0, 0, 1, 1, 2, 2, 0], 0, 1).unwrap();
        let shape = g.tree_shape().unwrap();
        assert_eq!(
            (shape.order(), shape.level_end(), shape.leaves()),
            (&[1, 2, 0][..], &[2, 3][..], &[3, 4, 5, 6, 7][..])
        );
        // Not tree-shaped: a node with no predecessor of the inner type (it joins the inner
        // subgraph) …
        let g = CellGraph::new(vec![0, 1, 1], &[vec![], vec![], vec![0, 1]]).unwrap();
        assert_eq!((g.plan().is_some(), g.tree_shape()), (true, None));
        // … two inner subgraphs …
        let g = CellGraph::new(vec![0, 1, 1], &[vec![], vec![0], vec![0]]).unwrap();
        assert_eq!((g.plan().is_some(), g.tree_shape()), (true, None));
        // … leaves of two types, or a leaf nothing depends on.
        let g = CellGraph::new(vec![0, 1, 2], &[vec![], vec![], vec![0, 1]]).unwrap();
        assert_eq!((g.plan().is_some(), g.tree_shape()), (true, None));
        let g = CellGraph::new(vec![0, 0, 1], &[vec![], vec![], vec![0]]).unwrap();
        assert_eq!((g.plan().is_some(), g.tree_shape()), (true, None));
        // The shape's levels are `levels()`'s, on TreeBank-like trees (those of one or two nodes
        // are paths, with runs instead).
        // (Miri interprets slowly: a few trees there.)
        for parents in crate::workload::treebank_trees(if cfg!(miri) { 4 } else { 300 }, 7) {
            let g = CellGraph::tree_of_parents(&parents, 0, 1).unwrap();
            let Some(shape) = g.plan().map(|_| g.tree_shape().expect("a tree has a tree shape")) else {
                continue;
            };
            let level = g.levels();
            let mut k = 0;
            for (i, &v) in shape.order().iter().enumerate() {
                if i == shape.level_end()[k] as usize {
                    k += 1;
                }
                assert_eq!(level[v as usize], k as u32, "node {v} of {parents:?}");
            }
            assert_eq!(shape.level_end().len(), k + 1);
        }
    }

    #[test]
    fn bad_graphs_are_refused() {
        assert!(CellGraph::new(vec![0, 0], &[vec![1], vec![0]]).is_err(), "cycle");
        assert!(CellGraph::new(vec![0], &[vec![0]]).is_err(), "self edge");
        assert!(CellGraph::new(vec![0], &[vec![3]]).is_err(), "out of range");
        assert!(CellGraph::new(vec![0, 1], &[vec![1], vec![]]).is_err(), "type order");
        assert!(CellGraph::new(vec![0], &[]).is_err(), "list count");
    }
}
