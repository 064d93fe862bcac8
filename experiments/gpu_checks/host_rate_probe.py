"""Why the host AdamW runs slower inside a training step than its start-up calibration (issue 23 item 1).

The script that ran on the lent H200 (session 18, two calls; results in
``experiments/results/host_rate_probe_s18.json``), from the repository root:

    PYTHONPATH=$PWD python -u experiments/gpu_checks/host_rate_probe.py none gpu dma up dn all ug gpu:15 all:15 none

(the first call: ``none dma gpu all none:15 dma:15 none:14 dma:14 all:14``, and its calibration also at 2**28).
It prints the start-up calibration (:func:`chunkjax.host_update.measure_host_update_rate`, 2**26 params), then
for each argument ``LOAD[:THREADS]`` the kernel's ns/param (fastest, median of 4 passes after a warm-up) walked
over the step's layout (K=32 chunks of C=39,321,600 params: float32 master and AdamW moments in numpy, the bf16
gradient and compute params in ``pinned_host`` jax arrays read through ``np.asarray`` and written through
``writable_view``, as :func:`chunkjax.updaters.host_updater` does; 20 GB), with THREADS numba threads, while LOAD
runs: ``none``; ``gpu`` (a thread running 4096^2 bf16 matmuls on the device); ``up`` / ``dn`` (a thread moving a
256 MiB buffer pinned host -> device / device -> pinned host, one transfer at a time); ``dma`` (both); ``all``
(both and the matmuls); ``ug`` (up and the matmuls); and the load's GB/s [up, down]. Compact on purpose: a device
call runs the session's checkout, so it was sent inline (a command of at most 2,000 characters).
"""
from time import perf_counter as T
import time,threading,statistics as S,numpy as np,jax,jax.numpy as jnp,numba,sys
from chunkjax.host_update import AdamW,host_update_,writable_view,measure_host_update_rate as M
from chunkjax.memory import sharding
P=lambda x,k='pinned_host':jax.device_put(x,sharding(k))
s={};M(2**26,stats=s);print('cal',s)
C=39321600;K=32;sp=AdamW(1e-4)
g0=np.random.default_rng(0).standard_normal(C,dtype=np.float32).astype(jnp.bfloat16)
ch=[]
for _ in range(K):
 st=sp.host_state(C);[getattr(st,f).fill(0) for f in"mv"];m=np.full(C,.01,np.float32);ch.append((st,m,P(g0),P(m.astype(jnp.bfloat16))))
def walk(t=None,n=4):
 p0=numba.get_num_threads()
 if t:numba.set_num_threads(t)
 r=[]
 for i in range(n+1):
  a=0
  for st,m,g,p in ch:
   t0=T();host_update_(sp,st,np.asarray(g).view(np.uint16),m,writable_view(p,np.uint16));a+=T()-t0
  if i:r.append(a/K/C)
 numba.set_num_threads(p0);return round(min(r)*1e9,4),round(S.median(r)*1e9,4)
h=P(np.zeros(2**27,jnp.bfloat16));d=P(np.zeros(2**27,jnp.bfloat16),'device');A=P(jnp.ones((4096,4096),jnp.bfloat16),'device')
mm=jax.jit(lambda a:a@a*1e-3)
def run(kind,t=None):
 ev=threading.Event();mv=[0,0]
 def up():
  while not ev.is_set():jax.device_put(h,sharding('device')).block_until_ready();mv[0]+=h.nbytes
 def dn():
  while not ev.is_set():jax.device_put(d,sharding('pinned_host')).block_until_ready();mv[1]+=d.nbytes
 def gp():
  x=A
  while not ev.is_set():
   for _ in range(8):x=mm(x)
   x.block_until_ready()
 fs={'none':[],'dma':[up,dn],'up':[up],'dn':[dn],'gpu':[gp],'all':[up,dn,gp],'ug':[up,gp]}[kind]
 th=[threading.Thread(target=f,daemon=True) for f in fs];t0=T()
 [x.start() for x in th]
 time.sleep(.2);r=walk(t);ev.set()
 [x.join() for x in th]
 dt=T()-t0;print(kind,t,r,[round(v/dt/1e9,1) for v in mv])
for k in sys.argv[1:]:
 a,_,b=k.partition(':');run(a,int(b) if b else None)
